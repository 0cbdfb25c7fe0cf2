"""LLM: offline batch generation. Give it prompts, get back one RequestOutput each.

The engine core runs in its own process (as vLLM's LLM does); `multiprocess=False`
keeps it in this process, for debugging with a plain traceback and breakpoints.

`LLM` blocks its caller (start-up for seconds, `generate` until every output is done):
made inside a running event loop (a notebook, an async web handler) it stalls that loop,
so it warns (`RuntimeWarning`) and points to `AsyncLLM`.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Sequence
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.engine.host_client import EngineCoreClient, SyncMPClient
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.errors import EngineOverloadedError, RequestFailedError
from asyncllm.frontend.chat import Messages, as_conversations
from asyncllm.frontend.chat_tools import attach_tool_calls, tools_and_constraint, with_tool_choice
from asyncllm.frontend.input_processor import PromptType
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one tokenized prompt
        return list(prompts)
    raise TypeError(
        f"prompts must be a str, a list of token ids, a dict or a list of those, got {type(prompts).__name__}"
    )


def _warn_in_running_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    warnings.warn(
        f"{what} blocks the running event loop (start-up takes seconds, generate() until "
        "every output is done); in async code use AsyncLLM, or run LLM in a thread",
        RuntimeWarning,
        stacklevel=3,
    )


class LLM:
    def __init__(
        self, model: str | None = None, *, multiprocess: bool = True, **engine_args: Any
    ) -> None:
        """Starts an engine. The core runs in its own process (SyncMPClient) unless
        `multiprocess=False` (InprocClient: the core in this process, for debugging)."""
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        client: type[EngineCoreClient] = SyncMPClient
        if not multiprocess:  # the named in-process path: torch and the model load here
            from asyncllm.engine.core_inproc import InprocClient

            client = InprocClient
        args = EngineArgs(model=model, **engine_args)
        _warn_in_running_loop("LLM()")
        self.engine = LLMEngine.from_engine_args(args, client)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is checked before any runs."""
        _warn_in_running_loop("LLM.generate()")
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, list | tuple):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {len(prompt_list)} prompts"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompt_list)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        frontend = self.engine.frontend
        checked: dict[int, SamplingParams] = {}  # (one check and copy for a shared object)
        for p in params_list:
            if id(p) not in checked:
                final = frontend.check_params(p).clone(output_kind=RequestOutputKind.FINAL_ONLY)
                checked[id(p)] = final
        params_list = [checked[id(p)] for p in params_list]
        tokenized = frontend.tokenize_prompts(prompt_list)  # the texts in one call
        for result in tokenized:
            if isinstance(result, Exception):
                raise result
        return self._run(list(zip(prompt_list, tokenized, params_list)), priority, use_tqdm)

    def _run(self, checked, priority, use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        try:
            for i, (prompt, tokenized, params) in enumerate(checked):
                rid = self.engine.next_request_id()
                self.engine.add_request(
                    rid, prompt, params, priority[i] if priority else 0, tokenized
                )
                ids.append(rid)
            results: dict[str, RequestOutput] = {}
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(ids), desc="generating", unit="req", dynamic_ncols=True)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
            return [results[rid] for rid in ids]
        except BaseException:
            self.engine.abort_request([rid for rid in ids])
            while self.engine.has_unfinished_requests():
                try:
                    self.engine.step()
                except (ValueError, EngineOverloadedError, RequestFailedError):
                    pass  # (another request's error: the first one is raised)
            raise

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = "auto",
    ) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts) or a list of them,
        through the tokenizer's chat template. With `tools` (OpenAI's function tools)
        the template renders them (a Hermes-style one where the model's ignores them),
        and each completion's `tool_calls` holds the calls parsed from its text;
        `tool_choice` 'required' or a named function forces one valid call, 'none'
        renders no tools."""
        frontend = self.engine.frontend
        rendered, constraint = tools_and_constraint(tools, tool_choice)
        if constraint is not None:
            if sampling_params is None or isinstance(sampling_params, SamplingParams):
                sampling_params = with_tool_choice(sampling_params, constraint)
            else:
                sampling_params = [with_tool_choice(p, constraint) or p for p in sampling_params]
        prompts: list[PromptType] = [
            frontend.chat_prompt(conv, add_generation_prompt, chat_template_kwargs, rendered)
            for conv in as_conversations(messages)
        ]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return [attach_tool_calls(o, rendered) for o in outs] if rendered is not None else outs

    def get_stats(self) -> dict[str, Any]:
        """Running/waiting requests, KV usage, prefix-cache hit rate, preemptions and
        latency histograms (TTFT, time per output token, end to end, queue time)."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
