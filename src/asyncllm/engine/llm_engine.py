"""LLMEngine: the synchronous shell under `LLM`. It owns the input processor, the
output processor and an engine-core client, and holds no scheduling logic."""

from __future__ import annotations

import itertools
from typing import Any

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.core.outputs import SchedulerStats
from asyncllm.engine.core_client import EngineCoreClient, InprocClient
from asyncllm.frontend.input_processor import InputProcessor, PromptType
from asyncllm.frontend.output_processor import OutputProcessor
from asyncllm.frontend.requests import register_request
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams


def load_tokenizer(config: EngineConfig) -> Any | None:
    if config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.tokenizer)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        args: EngineArgs,
        client_class: type[EngineCoreClient] = InprocClient,
    ) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = client_class(config, args)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, client_class: type[EngineCoreClient] = InprocClient
    ) -> LLMEngine:
        return cls(args.create_engine_config(), args, client_class)

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
        for req in register_request(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            priority,
            prompt_ids,
        ):
            self.client.add_request(req)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.client.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs. A request the core refused raises its error here."""
        core = self.client.get_output()
        processed = self.output_processor.process_outputs(core.outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        if processed.errors:
            rid, message = processed.errors[0]
            raise RuntimeError(f"request {rid!r} failed: {message}")
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.client.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.client.reset_prefix_cache()

    def shutdown(self) -> None:
        self.client.shutdown()
