"""AsyncLLM: per-request async generators over an engine-core process.

    async with AsyncLLM() as llm:
        async for out in llm.generate("Hello!", SamplingParams(max_tokens=64)):
            print(out.outputs[0].delta, end="", flush=True)

Everything that blocks (resolving and converting the model, loading the tokenizer,
waiting for the core to load the model, tokenizing a text prompt, rendering a chat
template) runs off the event loop, so a host's other tasks keep running: requests are
tokenized in order by one worker thread. Leaving an `async for` early (`break`, or a
generator closed by `contextlib.aclosing` or collected), cancelling its task or a
timeout aborts that request in the core. If the core dies, every pending generator
raises EngineDeadError and later calls raise it at once.

Under trio (the loop's primitives from `asyncllm.aio`) the life cycle is `async with
AsyncLLM(...) as llm:`, whose nursery holds the output task; cancel scopes abort requests
as asyncio's cancellation does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from asyncllm.aio import AsyncioLoop, TrioLoop, running_loop
from asyncllm.config import EngineArgs
from asyncllm.engine.heap import freeze_startup_objects, unfreeze_objects
from asyncllm.engine.host_client import AsyncMPClient, TrioMPClient
from asyncllm.engine.llm_engine import startup_error
from asyncllm.engine.tokenizer_process import ProcessTokenizer
from asyncllm.entrypoints.setup_batch import SetupThread
from asyncllm.errors import EngineDeadError, EngineStartupError
from asyncllm.frontend.chat import Messages
from asyncllm.frontend.chat_tools import tool_names, tools_and_constraint, with_tool_choice
from asyncllm.frontend.collector import RequestOutputCollector
from asyncllm.frontend.frontend import Frontend
from asyncllm.frontend.input_processor import PromptType, check_token_ids
from asyncllm.frontend.tool_calls import parse_tool_calls
from asyncllm.messages import EngineCoreOutputs, ResolvedConfig, SchedulerStats
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


class AsyncLLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.args = EngineArgs(model=model, **engine_args)
        self.config: ResolvedConfig | None = None  # as the engine core resolved it
        self.client: AsyncMPClient | None = None
        self.frontend: Frontend | None = None
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._aio: AsyncioLoop | TrioLoop | None = None  # the loop it was started on
        self._nursery_cm: Any = None  # under trio, `async with`'s nursery
        self._dead: str | None = None
        self._closed = False
        self._setup: SetupThread | None = None  # tokenization, chat templates
        self._tokenizer_process: ProcessTokenizer | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        if not isinstance(args, EngineArgs):
            raise TypeError(f"args must be an EngineArgs, got {type(args).__name__}")
        llm = cls()
        llm.args = args
        return llm

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> AsyncLLM:
        """Resolves the model, loads the tokenizer and starts the engine core, all off
        the event loop. Any failure raises EngineStartupError (the cause chained) and
        leaves the instance as it was, so `start()` may be called again. Under trio,
        use `async with AsyncLLM(...)` instead (its nursery holds the output task)."""
        return await self._start(running_loop(), nursery=None)

    async def _start(self, aio: AsyncioLoop | TrioLoop, nursery: Any) -> AsyncLLM:
        if self._aio is not None:
            raise RuntimeError("this AsyncLLM was already started")
        if isinstance(aio, TrioLoop) and nursery is None:
            raise RuntimeError(
                "under trio, start AsyncLLM with `async with AsyncLLM(...) as llm:` (its "
                "output task needs the block's nursery); start() works under asyncio only"
            )
        self._aio = aio
        client: AsyncMPClient | None = None
        tokenizer: ProcessTokenizer | None = None
        try:
            # The core resolves the model (the host imports no torch or transformers);
            # the tokenizer then loads in its own process while the core loads the model
            # (building it here would hold the GIL, and so the loop, 100-200 ms).
            try:
                cls = AsyncMPClient if nursery is None else TrioMPClient
                client = cls(self.args)
                config = await client.start()
                if config.tokenizer is not None:
                    tokenizer = await aio.to_thread(ProcessTokenizer, config.tokenizer)
                await client.wait_ready()
                ready = None if tokenizer is None else await aio.to_thread(tokenizer.wait_ready)
            except EngineStartupError:
                raise  # (the client's own: already says why)
            except Exception as e:
                raise startup_error(e) from e
            self.config = config
            self.frontend = Frontend(config, ready)
        except BaseException:
            with aio.shielded():
                try:
                    if client is not None:
                        await client.shutdown()
                finally:
                    if tokenizer is not None:
                        await aio.to_thread(tokenizer.close)
            self.config = self.frontend = None
            self._aio = None
            raise
        self._tokenizer_process = tokenizer
        self.client = client
        client.run_output_handler(
            self._on_outputs, self._on_dead, nursery, idle=lambda: not self._collectors
        )
        frontend = self.frontend
        assert frontend is not None
        self._setup = SetupThread(aio, lambda prompts: frontend.tokenize_prompts(prompts))
        freeze_startup_objects(collect=False)  # (on the loop: no full collection)
        return self

    async def __aenter__(self) -> AsyncLLM:
        aio = running_loop()
        if not isinstance(aio, TrioLoop):
            return await self._start(aio, nursery=None)
        import trio

        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        try:
            return await self._start(aio, nursery)
        except BaseException:
            await self._exit_nursery()
            raise

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.shutdown()
        finally:
            await self._exit_nursery()

    async def _exit_nursery(self) -> None:
        """Leaves trio's nursery once its output task has ended (shutdown cancelled it
        and waited). The block's own exception, if any, goes on from `__aexit__`
        unwrapped. (The nursery's scope must close at the level it opened: no shield.)"""
        cm, self._nursery_cm = self._nursery_cm, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(EngineDeadError("the engine was shut down"))
        try:
            if self.client is not None:
                assert self._aio is not None
                with self._aio.shielded():
                    await self.client.shutdown()
        finally:
            if self._setup is not None:
                self._setup.shutdown()
            tokenizer, self._tokenizer_process = self._tokenizer_process, None
            if tokenizer is not None and self._aio is not None:
                with self._aio.shielded():
                    await self._aio.to_thread(tokenizer.close)  # (it exits on EOF)
            unfreeze_objects()

    @property
    def is_running(self) -> bool:
        return self.client is not None and not self._closed and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return EngineDeadError(self._dead) if self._dead else None

    @property
    def tokenizer(self) -> Any:
        return self.frontend.tokenizer if self.frontend is not None else None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _check_usable(self) -> tuple[Frontend, AsyncMPClient]:
        """The frontend and the client, if this instance may be used from here now."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.client is None or self.frontend is None or self._aio is None:
            raise RuntimeError(
                "AsyncLLM is not started: use `async with AsyncLLM(...)` or `await llm.start()`"
            )
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if not self._aio.is_current():
            raise RuntimeError(
                "AsyncLLM is used from an event loop other than the one it was started on; "
                "create it inside the loop that uses it"
            )
        return self.frontend, self.client

    # -- outputs from the core -------------------------------------------------------

    def _on_outputs(self, core: EngineCoreOutputs) -> None:
        assert self.frontend is not None and self.client is not None
        processed = self.frontend.process_outputs(core.outputs)
        for out in processed.request_outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        for rid, error in processed.errors:
            collector = self._collectors.get(rid)
            if collector is not None:
                collector.fail(error)
        if processed.reqs_to_abort and self._dead is None:
            self.client.abort_requests(processed.reqs_to_abort)

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
        frontend, client = self._check_usable()
        if request_id is None:
            request_id = frontend.new_request_id()
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = frontend.check_params(sampling_params)
        assert self._aio is not None  # (_check_usable passed)
        collector = RequestOutputCollector(params.output_kind, self._aio.event())
        # The id is this generator's from here on, the tokenizer's await included: a
        # generator that reuses it meanwhile is refused, and this one's end forgets and
        # aborts only its own request.
        self._collectors[request_id] = collector
        added = finished = False
        try:
            tokenized = None
            if _is_text(prompt):
                assert self._setup is not None  # (_check_usable passed)
                tokenized = await self._setup.tokenize(prompt)
                frontend, client = self._check_usable()  # (it may have died meanwhile)
            core_reqs = frontend.add_request(request_id, prompt, params, priority, tokenized)
            added = True
            try:
                for req in core_reqs:
                    client.add_request(req)
            except EngineDeadError:
                # A death the client has seen (the core's process gone) is reported by
                # the output handler, with the core's own reason where it sent one: this
                # request's stream ends with that, as every other one does.
                if client.dead_reason is None:
                    raise
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if self._collectors.get(request_id) is collector:
                del self._collectors[request_id]
            if added and not finished:
                self._abort_now(request_id)

    async def chat(
        self,
        messages: Messages,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = "auto",
    ) -> AsyncGenerator[RequestOutput, None]:
        """One conversation through the tokenizer's chat template, streamed. With
        `tools` (as in `LLM.chat`) the text streams as it comes, and each completion
        carries its parsed `tool_calls` in the output where it ends (its whole text
        parsed, whatever the output kind; with n > 1 that may be before the last)."""
        rendered, constraint = tools_and_constraint(tools, tool_choice)
        sampling_params = with_tool_choice(sampling_params, constraint)
        prompt = await self.render_chat(
            messages, add_generation_prompt, chat_template_kwargs, rendered
        )
        names = None if rendered is None else tool_names(rendered)
        texts: dict[int, str] = {}  # each completion's whole text so far
        delta = sampling_params is not None and (
            sampling_params.output_kind == RequestOutputKind.DELTA
        )
        async for out in self.generate(prompt, sampling_params, request_id, priority):
            if rendered is not None:
                for c in out.outputs:
                    texts[c.index] = texts.get(c.index, "") + c.text if delta else c.text
                for c in out.outputs:  # (each when it ends: with n > 1 DELTA, in its own output)
                    if c.finish_reason is not None:
                        content, calls = parse_tool_calls(texts[c.index], names)
                        if calls:
                            c.tool_calls = calls
                            if not delta:
                                c.text = content
            yield out

    async def render_chat(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> dict[str, Any]:
        """The prompt (`{"prompt_token_ids": [...]}`) of one conversation through the
        tokenizer's chat template, rendered in the setup thread (`add_special_tokens`:
        the tokenizer's own, a BOS, on top of the template's)."""
        frontend, _ = self._check_usable()
        assert self._setup is not None  # (_check_usable passed)
        prompt: dict[str, Any] = await self._setup.run(
            frontend.chat_prompt,
            messages,
            add_generation_prompt,
            chat_template_kwargs,
            tools,
            add_special_tokens,
        )
        return prompt

    async def prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """The token ids `generate` sends for `prompt`, checked as it checks them
        (ValueError/TypeError naming the problem: a prompt longer than max_model_len, an
        id outside the vocabulary); text is tokenized with the prompts arriving with it.
        Generating from `{"prompt_token_ids": ids}` then tokenizes nothing again."""
        frontend, _ = self._check_usable()
        if not _is_text(prompt):
            return frontend.tokenize_prompt(prompt)[1]
        assert self._setup is not None  # (_check_usable passed)
        return (await self._setup.tokenize(prompt))[1]

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ids for `text` (in its process, off the loop), whatever their
        number: unlike a prompt's, they are not checked against the model."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        tokenizer = self._tokenizer_or_refuse()
        assert self._setup is not None  # (_check_usable passed)
        encoding = await self._setup.run(tokenizer, text, add_special_tokens)
        return list(encoding.input_ids)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (each in the model's vocabulary, else ValueError)."""
        tokenizer = self._tokenizer_or_refuse()
        ids = check_token_ids(token_ids, self.config.vocab_size if self.config else None)
        return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """Each id's entry in the tokenizer's vocabulary (as `tokenizer.convert_ids_to_tokens`),
        from the tokenizer process."""
        tokenizer = self._tokenizer_or_refuse()
        ids = check_token_ids(token_ids, self.config.vocab_size if self.config else None)
        assert self._setup is not None  # (_check_usable passed)
        tokens: list[str] = await self._setup.run(tokenizer.convert_ids_to_tokens, ids)
        return tokens

    def _tokenizer_or_refuse(self) -> Any:
        frontend, _ = self._check_usable()
        if frontend.tokenizer is None:
            raise ValueError("this needs the tokenizer (skip_tokenizer_init is set)")
        return frontend.tokenizer

    def _abort_now(self, request_id: str) -> None:
        """Forgets the request here and tells the core; never blocks, never raises."""
        if self.frontend is None or self.client is None:
            return
        self._abort_in_core(self.frontend.abort_requests([request_id]))

    def _abort_in_core(self, core_ids: list[str]) -> None:
        """Tells a live core to drop these requests; never blocks, never raises."""
        if core_ids and self.client is not None and self._dead is None and not self._closed:
            try:
                self.client.abort_requests(core_ids)
            except EngineDeadError:
                pass

    async def abort(self, request_id: str | list[str]) -> None:
        """Ends requests (by id, or a child id `"{i}_{id}"` of an n > 1 request): each
        stream yields a last output with finish_reason 'abort' and ends, as in vLLM.
        Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.frontend is None or self.client is None:
            return
        core_ids, outputs = self.frontend.finish_aborted(ids)
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        self._abort_in_core(core_ids)

    async def check_health(self, timeout: float = 10.0) -> None:
        """Raises EngineDeadError unless the core answers within `timeout` seconds."""
        _, client = self._check_usable()
        try:
            await client.call_utility("ping", timeout=timeout)
        except TimeoutError:
            raise EngineDeadError(f"the engine core did not answer within {timeout} s") from None

    async def get_stats(self) -> dict[str, Any]:
        """Running/waiting requests, KV usage, prefix-cache hit rate, preemptions and
        latency histograms (TTFT, time per output token, end to end, queue time)."""
        frontend, client = self._check_usable()
        core = msgspec.convert(await client.call_utility("get_stats"), SchedulerStats)
        return frontend.stats(core)

    async def reset_prefix_cache(self) -> bool:
        _, client = self._check_usable()
        return bool(await client.call_utility("reset_prefix_cache"))

    @property
    def engine_core_pid(self) -> int | None:
        return self.client.process.pid if self.client is not None else None


__all__ = ["AsyncLLM"]


def _is_text(prompt: Any) -> bool:
    """Whether a prompt needs the tokenizer (text, not token ids)."""
    if isinstance(prompt, dict):
        return "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str)
    return isinstance(prompt, str)
