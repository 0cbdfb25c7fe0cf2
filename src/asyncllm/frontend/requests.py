"""Registering a user request with the frontend: validation, tokenization, n > 1 fan-out."""

from __future__ import annotations

from asyncllm.engine.messages import EngineCoreRequest
from asyncllm.frontend.input_processor import InputProcessor, PromptType
from asyncllm.frontend.output_processor import OutputProcessor, ParentRequest, child_request_id
from asyncllm.sampling_params import SamplingParams


def register_request(
    ip: InputProcessor,
    op: OutputProcessor,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams | None,
    priority: int = 0,
    prompt_ids: list[int] | None = None,
) -> list[EngineCoreRequest]:
    """Checks everything, registers the request's state, and returns the core requests
    to send (one, or n children that share the prompt and its cached blocks)."""
    params = ip.check_params(params)
    prompt_text = prompt if isinstance(prompt, str) else None
    if prompt_ids is None:
        prompt_text, prompt_ids = ip.tokenize_prompt(prompt)
    if request_id in op.states or request_id in op.parents:
        raise ValueError(f"request id {request_id!r} is already in use")
    if params.n == 1:
        req = ip.process(request_id, prompt, params, priority, prompt_ids)
        op.add_request(request_id, prompt_text, prompt_ids, params)
        return [req]
    parent = ParentRequest(request_id, params.n, params.output_kind)
    reqs = []
    for i in range(params.n):
        child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
        cid = child_request_id(request_id, i)
        reqs.append(ip.process(cid, prompt, child_params, priority, prompt_ids))
        op.add_request(cid, prompt_text, prompt_ids, child_params, parent, i)
    return reqs
