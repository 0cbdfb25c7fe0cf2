"""The request path that `LLM` (through LLMEngine) and `AsyncLLM` share.

A `Frontend` turns user requests into engine-core requests (validation, tokenization,
n > 1 fan-out) and engine-core outputs into RequestOutputs (detokenization, stop
strings, logprobs, n > 1 fan-in), keeps the latency statistics, and maps the core's
typed request errors to the public exceptions. It knows nothing of transport: the
caller sends what it returns over whichever engine-core client it owns.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncllm.errors import EngineOverloadedError, RequestFailedError
from asyncllm.frontend.chat import Messages, render_chat
from asyncllm.frontend.input_processor import InputProcessor, PromptType
from asyncllm.frontend.output_processor import OutputProcessor, ParentRequest, child_request_id
from asyncllm.frontend.stats import LatencyStats, stats_dict
from asyncllm.hf_tokenizer import load_hf_tokenizer
from asyncllm.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorKind,
    RequestError,
    ResolvedConfig,
    SchedulerStats,
)
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams


def load_tokenizer(config: ResolvedConfig) -> Any | None:
    """The transformers tokenizer in this process (LLM's; AsyncLLM's lives in a process
    of its own)."""
    if config.tokenizer is None:
        return None
    return load_hf_tokenizer(config.tokenizer)


def request_exception(request_id: str, error: RequestError) -> Exception:
    """The exception a caller sees for a request the core refused or failed."""
    if error.kind is ErrorKind.OVERLOADED:
        return EngineOverloadedError(f"request {request_id!r} refused: {error.message}")
    if error.kind is ErrorKind.INVALID:
        return ValueError(f"request {request_id!r}: {error.message}")
    return RequestFailedError(f"request {request_id!r} failed: {error.message}")


@dataclass
class FrontendOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # core ids that ended here (stop string) but still run there
    errors: list[tuple[str, Exception]] = field(default_factory=list)  # (user id, error)


class Frontend:
    def __init__(self, config: ResolvedConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.latency = LatencyStats()
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    @classmethod
    def create(cls, config: ResolvedConfig) -> Frontend:
        """Loads the tokenizer (seconds: call it off an event loop)."""
        return cls(config, load_tokenizer(config))

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def has_request(self, request_id: str) -> bool:
        op = self.output_processor
        return request_id in op.states or request_id in op.parents

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # -- requests in ---------------------------------------------------------------------

    def check_params(self, params: Any) -> SamplingParams:
        return self.input_processor.check_params(params)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize_prompt(prompt)

    def tokenize_prompts(
        self, prompts: list[PromptType]
    ) -> list[tuple[str | None, list[int]] | Exception]:
        return self.input_processor.tokenize_prompts(prompts)

    def chat_prompt(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> dict[str, Any]:
        return render_chat(
            self.tokenizer,
            messages,
            add_generation_prompt,
            chat_template_kwargs,
            tools,
            add_special_tokens,
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        priority: int = 0,
        tokenized: tuple[str | None, list[int]] | None = None,
    ) -> list[EngineCoreRequest]:
        """Checks everything, registers the request's state, and returns the core requests
        to send: one, or n children that share the prompt and its cached blocks.
        `tokenized` is `tokenize_prompt(prompt)` when the caller has it already. Raises
        ValueError/TypeError (naming the field) before anything is registered."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError("request_id must be a non-empty str")
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ip, op = self.input_processor, self.output_processor
        params = ip.check_params(params)
        prompt_text, prompt_ids = tokenized or ip.tokenize_prompt(prompt)
        if params.n == 1:
            req = ip.process(request_id, prompt, params, priority, prompt_ids)
            op.add_request(request_id, prompt_text, prompt_ids, params)
            return [req]
        child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        taken = [cid for cid in child_ids if self.has_request(cid)]
        if taken:  # checked before anything is registered: all or nothing
            raise ValueError(
                f"request id {request_id!r} needs child ids {child_ids}, and {taken[0]!r} "
                "is already in use"
            )
        parent = ParentRequest(request_id, params.n, params.output_kind)
        reqs = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            child_params = params.clone(n=1, seed=seed)
            cid = child_request_id(request_id, i)
            reqs.append(ip.process(cid, prompt, child_params, priority, prompt_ids))
        for i, req in enumerate(reqs):
            op.add_request(req.request_id, prompt_text, prompt_ids, req.sampling_params, parent, i)
        return reqs

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets requests whose consumer is gone (by user-facing id); returns the core
        ids to abort."""
        return self.output_processor.abort_requests(request_ids)

    def finish_aborted(self, request_ids: list[str]) -> tuple[list[str], list[RequestOutput]]:
        """A user abort (by user-facing or child id): the requests end with finish_reason
        'abort' and a last output each. Returns (the core ids to abort, the outputs)."""
        return self.output_processor.finish_aborted(request_ids)

    # -- outputs out ---------------------------------------------------------------------

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> FrontendOutputs:
        processed = self.output_processor.process_outputs(outputs)
        for out in processed.request_outputs:
            if out.finished:
                self.latency.observe(out)
        errors = [(rid, request_exception(rid, err)) for rid, err in processed.errors]
        return FrontendOutputs(processed.request_outputs, processed.reqs_to_abort, errors)

    def stats(self, core: SchedulerStats) -> dict[str, Any]:
        return stats_dict(core, self.latency, len(self.output_processor.states))
