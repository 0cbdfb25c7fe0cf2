"""AsyncLLM: per-request async generators over an engine-core process.

    async with AsyncLLM() as llm:
        async for out in llm.generate("Hello!", SamplingParams(max_tokens=64)):
            print(out.outputs[0].delta, end="", flush=True)

Everything that blocks (resolving and converting the model, loading the tokenizer,
waiting for the core to load the model) runs off the event loop, so a host's other
tasks keep running. Leaving an `async for` early, cancelling its task or a timeout
aborts that request in the core. If the core dies, every pending generator raises
EngineDeadError and later calls raise it at once.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.core.outputs import EngineCoreOutputs, SchedulerStats
from asyncllm.engine.core_client import AsyncMPClient
from asyncllm.engine.core_process import EngineDeadError, EngineOverloadedError
from asyncllm.engine.llm_engine import load_tokenizer
from asyncllm.frontend.input_processor import InputProcessor, PromptType
from asyncllm.frontend.output_processor import OutputProcessor
from asyncllm.frontend.requests import register_request
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets": list(self.buckets) + ["+inf"],
            "counts": list(self.counts),
            "count": self.n,
            "mean": self.total / self.n if self.n else None,
        }


def _merge_delta(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """A slow consumer gets one output covering every delta it missed."""
    by_index = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            pending.outputs.append(c)
            continue
        old.text += c.text
        old.delta += c.delta
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    pending.metrics = new.metrics
    return pending


class RequestOutputCollector:
    """Holds what a request's generator has not consumed yet: at most one output, into
    which later ones are merged, so memory stays bounded whatever the consumer's pace."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if self.output is None or self.kind is not RequestOutputKind.DELTA:
            if self.output is not None and self.kind is RequestOutputKind.CUMULATIVE:
                # A cumulative output replaces the last, but its delta covers both.
                for c in out.outputs:
                    prev = next((p for p in self.output.outputs if p.index == c.index), None)
                    if prev is not None:
                        c.delta = prev.delta + c.delta
            self.output = out
        else:
            self.output = _merge_delta(self.output, out)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        out, self.output = self.output, None
        return out


class AsyncLLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.args = EngineArgs(model=model, **engine_args)
        self.config: EngineConfig | None = None
        self.client: AsyncMPClient | None = None
        self.tokenizer: Any = None
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._closed = False
        self._ids = itertools.count()
        self._ttft = Histogram()
        self._tpot = Histogram()
        self._e2e = Histogram()
        self._queue = Histogram()
        self._last_core_stats = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        if not isinstance(args, EngineArgs):
            raise TypeError(f"args must be an EngineArgs, got {type(args).__name__}")
        llm = cls()
        llm.args = args
        return llm

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> AsyncLLM:
        if self._loop is not None:
            raise RuntimeError("this AsyncLLM was already started")
        self._loop = asyncio.get_running_loop()
        self.config = await asyncio.to_thread(self.args.create_engine_config)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = AsyncMPClient(self.args)
        try:
            await self.client.start()
        except BaseException:
            await self.client.shutdown()
            self._closed = True
            raise
        self.client.run_output_handler(self._on_outputs, self._on_dead)
        return self

    async def __aenter__(self) -> AsyncLLM:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(EngineDeadError("the engine was shut down"))
        if self.client is not None:
            await self.client.shutdown()

    @property
    def is_running(self) -> bool:
        return self.client is not None and not self._closed and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return EngineDeadError(self._dead) if self._dead else None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.client is None or self._loop is None:
            raise RuntimeError(
                "AsyncLLM is not started: use `async with AsyncLLM(...)` or `await llm.start()`"
            )
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self._loop:
            raise RuntimeError(
                "AsyncLLM is used from an event loop other than the one it was started on; "
                "create it inside the loop that uses it"
            )

    # -- outputs from the core -------------------------------------------------------

    def _on_outputs(self, core: EngineCoreOutputs) -> None:
        if core.scheduler_stats is not None:
            self._last_core_stats = core.scheduler_stats
        processed = self.output_processor.process_outputs(core.outputs)
        for out in processed.request_outputs:
            if out.finished:
                self._observe(out)
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        for rid, message in processed.errors:
            collector = self._collectors.get(rid)
            if collector is not None:
                cls = EngineOverloadedError if message.startswith("overloaded") else RuntimeError
                collector.fail(cls(message))
        if processed.reqs_to_abort and self._dead is None:
            self.client.abort_requests(processed.reqs_to_abort)

    def _observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if "first_token_time" in m:
            self._ttft.observe(m["first_token_time"] - m["arrival_time"])
            n = max(len(c.token_ids) for c in out.outputs)
            if "finished_time" in m and n > 1:
                self._tpot.observe((m["finished_time"] - m["first_token_time"]) / (n - 1))
        if "finished_time" in m:
            self._e2e.observe(m["finished_time"] - m["arrival_time"])
        if "first_scheduled_time" in m:
            self._queue.observe(max(m["first_scheduled_time"] - m["arrival_time"], 0.0))

    def _on_dead(self, reason: str) -> None:
        self._dead = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: BaseException) -> None:
        for collector in self._collectors.values():
            collector.fail(error)

    # -- requests ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields RequestOutputs for one request until it finishes. Bad input raises
        ValueError/TypeError before anything is sent to the engine."""
        self._check_usable()
        if request_id is None:
            request_id = f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError("request_id must be a non-empty str")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.input_processor.check_params(sampling_params)
        core_reqs = register_request(
            self.input_processor, self.output_processor, request_id, prompt, params, priority
        )
        collector = RequestOutputCollector(params.output_kind)
        self._collectors[request_id] = collector
        finished = False
        try:
            for req in core_reqs:
                self.client.add_request(req)
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One conversation through the tokenizer's chat template, streamed."""
        self._check_usable()
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise TypeError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
            )
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **(chat_template_kwargs or {}),
        )
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        async for out in self.generate(
            {"prompt_token_ids": list(ids)}, sampling_params, request_id, priority
        ):
            yield out

    def _abort_now(self, request_id: str) -> None:
        """Forgets the request here and tells the core; never blocks, never raises."""
        core_ids = self.output_processor.abort_requests([request_id])
        if core_ids and self._dead is None and not self._closed:
            try:
                self.client.abort_requests(core_ids)
            except EngineDeadError:
                pass

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._abort_now(rid)
            collector = self._collectors.get(rid)
            if collector is not None:
                collector.fail(asyncio.CancelledError(f"request {rid!r} was aborted"))

    async def check_health(self, timeout: float = 10.0) -> None:
        """Raises EngineDeadError unless the core answers within `timeout` seconds."""
        self._check_usable()
        try:
            await self.client.call_utility("ping", timeout=timeout)
        except TimeoutError:
            raise EngineDeadError(f"the engine core did not answer within {timeout} s") from None

    async def get_stats(self) -> dict[str, Any]:
        self._check_usable()
        stats = SchedulerStats(**await self.client.call_utility("get_stats"))
        out = {f: getattr(stats, f) for f in stats.__struct_fields__}
        q = out.get("prefix_cache_queries", 0)
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / q if q else 0.0
        out["num_frontend_requests"] = len(self._collectors)
        out["ttft_s"] = self._ttft.as_dict()
        out["tpot_s"] = self._tpot.as_dict()
        out["e2e_latency_s"] = self._e2e.as_dict()
        out["queue_time_s"] = self._queue.as_dict()
        return out

    async def reset_prefix_cache(self) -> bool:
        self._check_usable()
        return bool(await self.client.call_utility("reset_prefix_cache"))

    @property
    def engine_core_pid(self) -> int | None:
        return self.client.process.pid if self.client is not None else None


__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]
