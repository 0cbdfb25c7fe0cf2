"""LLMEngine: the synchronous shell under `LLM`. It owns a Frontend (input and output
processing, shared with AsyncLLM) and an engine-core client, and holds no scheduling
logic of its own."""

from __future__ import annotations

from collections import deque
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.engine.heap import freeze_startup_objects, unfreeze_objects
from asyncllm.engine.host_client import EngineCoreClient, SyncMPClient
from asyncllm.errors import EngineStartupError
from asyncllm.frontend.frontend import Frontend
from asyncllm.frontend.input_processor import PromptType
from asyncllm.messages import ResolvedConfig
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams


def startup_error(e: Exception) -> EngineStartupError:
    """What a failure while starting an engine is raised as (`from e`): the reason in
    the message, the original exception as the cause."""
    return EngineStartupError(f"{type(e).__name__}: {e}")


class LLMEngine:
    def __init__(
        self, config: ResolvedConfig, frontend: Frontend, client: EngineCoreClient
    ) -> None:
        self.config = config
        self.frontend = frontend
        self.client = client
        # A step that raised a request's error: the other outputs it had, and the other
        # errors, come with the next steps (one error a call) rather than being lost.
        self._carried: list[RequestOutput] = []
        self._errors: deque[BaseException] = deque()

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, client_class: type[EngineCoreClient] = SyncMPClient
    ) -> LLMEngine:
        """Starts an engine; any failure raises EngineStartupError (cause chained). The
        tokenizer loads here while the core loads its model."""
        try:
            client = client_class(args)
        except EngineStartupError:
            raise  # (the client's own: already says why)
        except Exception as e:
            raise startup_error(e) from e
        try:
            frontend = Frontend.create(client.config)
            client.wait_ready()
        except BaseException as e:
            client.shutdown()
            if isinstance(e, EngineStartupError) or not isinstance(e, Exception):
                raise
            raise startup_error(e) from e
        freeze_startup_objects()
        return cls(client.config, frontend, client)

    def get_tokenizer(self) -> Any | None:
        return self.frontend.tokenizer

    def next_request_id(self) -> str:
        return self.frontend.new_request_id()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        tokenized: tuple[str | None, list[int]] | None = None,
    ) -> None:
        """Validates and queues a request; n > 1 becomes n child requests in the core.
        If the core refuses one at once (the in-process core raises), the frontend
        forgets the request and any child the core took is aborted before the error
        propagates: nothing is left waiting for outputs that will never come."""
        for req in self.frontend.add_request(request_id, prompt, params, priority, tokenized):
            try:
                self.client.add_request(req)
            except BaseException:
                self.client.abort_requests(self.frontend.abort_requests([request_id]))
                raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.client.abort_requests(self.frontend.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs. A request the core refused or failed raises its
        error here (EngineOverloadedError, ValueError, RequestFailedError); the other
        requests' outputs of that step come with the next call, as do further errors
        (one a call). With no unfinished request it returns at once: an idle core sends
        nothing to wait for."""
        outputs, self._carried = self._carried, []
        if not self._errors and self.frontend.has_unfinished_requests():
            core = self.client.get_output()
            processed = self.frontend.process_outputs(core.outputs)
            if processed.reqs_to_abort:
                self.client.abort_requests(processed.reqs_to_abort)
            if not self.frontend.has_unfinished_requests():
                self.client.settle()
            outputs += processed.request_outputs
            self._errors.extend(error for _, error in processed.errors)
        if self._errors:
            self._carried = outputs
            raise self._errors.popleft()
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or outputs and errors of a step that raised, still to
        come from `step()`."""
        return bool(self._carried or self._errors) or self.frontend.has_unfinished_requests()

    def get_stats(self) -> dict[str, Any]:
        return self.frontend.stats(self.client.get_stats())

    def reset_prefix_cache(self) -> bool:
        return self.client.reset_prefix_cache()

    def shutdown(self) -> None:
        try:
            self.client.shutdown()
        finally:
            unfreeze_objects()
