"""LLMEngine: the synchronous shell under `LLM`. It owns the input processor, the
output processor and an engine-core client, and holds no scheduling logic."""

from __future__ import annotations

import itertools
from typing import Any

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.core.outputs import SchedulerStats
from asyncllm.engine.core_client import EngineCoreClient, InprocClient
from asyncllm.frontend.input_processor import InputProcessor, PromptType
from asyncllm.frontend.output_processor import OutputProcessor, ParentRequest, child_request_id
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams


def load_tokenizer(config: EngineConfig) -> Any | None:
    if config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.tokenizer)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, client_class: type[EngineCoreClient] = InprocClient
    ) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = client_class(config)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """Validates and queues a request; n > 1 becomes n child requests in the core."""
        params = self.input_processor.check_params(params)
        prompt_text = prompt if isinstance(prompt, str) else None
        if prompt_ids is None:
            prompt_text, prompt_ids = self.input_processor.tokenize_prompt(prompt)
        if (
            request_id in self.output_processor.states
            or request_id in self.output_processor.parents
        ):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            req = self.input_processor.process(request_id, prompt, params, priority, prompt_ids)
            self.output_processor.add_request(request_id, prompt_text, prompt_ids, params)
            self.client.add_request(req)
            return
        parent = ParentRequest(request_id, params.n, params.output_kind)
        for i in range(params.n):
            child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            cid = child_request_id(request_id, i)
            req = self.input_processor.process(cid, prompt, child_params, priority, prompt_ids)
            self.output_processor.add_request(cid, prompt_text, prompt_ids, child_params, parent, i)
            self.client.add_request(req)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.client.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        core = self.client.get_output()
        processed = self.output_processor.process_outputs(core.outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.client.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.client.reset_prefix_cache()

    def shutdown(self) -> None:
        self.client.shutdown()
