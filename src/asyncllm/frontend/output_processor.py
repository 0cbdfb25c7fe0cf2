"""Turns engine-core outputs into RequestOutputs: text, stop strings, logprobs, n > 1.

A request with n > 1 runs as n child requests in the core; their outputs are gathered
back here into one RequestOutput under the parent's id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from asyncllm.frontend.detokenizer import IncrementalDetokenizer
from asyncllm.messages import EngineCoreOutput, RequestError
from asyncllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.step_io import TokenLogprobs


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


@dataclass
class ParentRequest:
    request_id: str
    n: int
    kind: RequestOutputKind
    children: dict[int, RequestState] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.children) == self.n and all(
            c.finish_reason is not None for c in self.children.values()
        )


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any | None,
        parent: ParentRequest | None,
        index: int,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.parent = parent
        self.index = index
        self.detok = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                [params.stop] if isinstance(params.stop, str) else params.stop,
                params.include_stop_str_in_output,
            )
            if tokenizer is not None
            else None
        )
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.sent_prompt_logprobs = 0  # DELTA outputs carry each position's once
        self.sent_text = 0  # characters already handed out
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.metrics = {"arrival_time": arrival_time}

    @property
    def text(self) -> str:
        return self.detok.output_text if self.detok is not None else ""

    def visible_text(self) -> str:
        text = self.text
        if self.finish_reason is None and self.detok is not None:
            hold = self.detok.holdback()
            if hold:
                text = text[:-hold]
        return text

    def _to_dicts(self, lp: TokenLogprobs) -> list[PositionLogprobs]:
        out = []
        for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            d: PositionLogprobs = {}
            for j, (tok, val) in enumerate(zip(ids, lps)):
                if tok in d:
                    continue
                r = rank if j == 0 else j
                d[tok] = Logprob(val, r, self._decode_one(tok))
            out.append(d)
        return out

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def update(self, out: EngineCoreOutput) -> bool:
        """Applies one core output; True if a stop string ended the request here."""
        now = time.monotonic()
        if out.new_token_ids and "first_token_time" not in self.metrics:
            self.metrics["first_token_time"] = now
        if out.first_scheduled_time and "first_scheduled_time" not in self.metrics:
            self.metrics["first_scheduled_time"] = out.first_scheduled_time
        self.num_cached_tokens = out.num_cached_tokens
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._to_dicts(out.new_prompt_logprobs))
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and self.logprobs is not None:
            dicts = self._to_dicts(out.new_logprobs)
            self.logprobs.extend(dicts)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(
                lp[0] for lp in out.new_logprobs.logprobs
            )
        stopped = False
        text_ids = out.new_token_ids
        if (
            out.finish_reason == "stop"
            and not isinstance(out.stop_reason, str)
            and not self.params.include_stop_str_in_output
        ):
            # A stop token (EOS or one of stop_token_ids) stays in token_ids, but its
            # text is left out, as vLLM does, unless include_stop_str_in_output.
            text_ids = text_ids[:-1]
        if self.detok is not None and text_ids:
            stop = self.detok.update(text_ids)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                stopped = out.finish_reason is None  # the core still runs it: abort there
        if self.finish_reason is None and out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.finish_reason is not None:
            self.metrics["finished_time"] = now
            self.metrics["num_generation_tokens"] = len(self.token_ids)
        return stopped

    def abort(self) -> None:
        """Ends the request here (a user abort): finish_reason 'abort'."""
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = "abort", None
            self.metrics["finished_time"] = time.monotonic()
            self.metrics["num_generation_tokens"] = len(self.token_ids)

    def has_new_prompt_logprobs(self, kind: RequestOutputKind) -> bool:
        if self.prompt_logprobs is None:
            return False
        if kind is RequestOutputKind.DELTA:
            return len(self.prompt_logprobs) > self.sent_prompt_logprobs
        return True

    def take_prompt_logprobs(self, kind: RequestOutputKind) -> list[PositionLogprobs | None] | None:
        """All prompt logprobs so far; for DELTA, only those not sent before ([] when
        none are new, as vLLM: None means they were not asked for), so each position
        goes out once."""
        lps = self.prompt_logprobs
        if lps is None or kind is not RequestOutputKind.DELTA:
            return lps
        new = lps[self.sent_prompt_logprobs :]
        self.sent_prompt_logprobs = len(lps)
        return new

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        text = self.visible_text()
        delta = text[self.sent_text :]
        if kind is RequestOutputKind.DELTA:
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = self.logprobs[self.sent_logprobs :] if self.logprobs is not None else None
            shown_text = delta
        else:
            token_ids, logprobs, shown_text = list(self.token_ids), self.logprobs, text
            if logprobs is not None:
                logprobs = list(logprobs)
        self.sent_text, self.sent_tokens = len(text), len(self.token_ids)
        self.sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        return CompletionOutput(
            index=self.index,
            text=shown_text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta=delta,
        )


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # ended here (stop string) but still running in the core
    errors: list[tuple[str, RequestError]] = field(default_factory=list)  # (user request id, why)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer,
            parent,
            index,
            time.monotonic(),
        )
        self.states[request_id] = state
        if parent is not None:
            parent.children[index] = state
            self.parents[parent.request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets requests (by user-facing or child id); returns the core ids to abort."""
        core_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                for child in parent.children.values():
                    if self.states.pop(child.request_id, None) is not None:
                        core_ids.append(child.request_id)
            elif self.states.pop(rid, None) is not None:
                core_ids.append(rid)
        return core_ids

    def finish_aborted(self, request_ids: list[str]) -> tuple[list[str], list[RequestOutput]]:
        """A user abort, by user-facing or child id: every unfinished request it names
        ends with finish_reason 'abort' and a last RequestOutput (under the parent's id
        for a child, final once every child has ended). Returns (the core ids to abort,
        those outputs)."""
        core_ids: list[str] = []
        outputs: list[RequestOutput] = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is not None:
                states = [c for c in parent.children.values() if c.request_id in self.states]
            elif rid in self.states:
                states = [self.states[rid]]
            else:
                continue  # finished already, or never known
            for state in states:
                state.abort()
                del self.states[state.request_id]
                core_ids.append(state.request_id)
            # (DELTA: one output with every child aborted here, each its last)
            ro = self._make_output(states[-1], delta_children=states) if states else None
            if ro is not None:
                outputs.append(ro)
        return core_ids, outputs

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs([], [])
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # already ended here (stop string, user abort)
            if out.error is not None:
                user_id = state.parent.request_id if state.parent is not None else out.request_id
                result.reqs_to_abort.extend(self.abort_requests([user_id]))
                result.errors.append((user_id, out.error))
                continue
            if state.update(out):
                result.reqs_to_abort.append(out.request_id)
            ro = self._make_output(state)
            if state.finish_reason is not None:
                del self.states[out.request_id]
            if ro is not None:
                result.request_outputs.append(ro)
        return result

    def _make_output(
        self, state: RequestState, delta_children: list[RequestState] | None = None
    ) -> RequestOutput | None:
        kind = state.params.output_kind
        parent = state.parent
        if parent is None:
            finished = state.finish_reason is not None
            if kind is RequestOutputKind.FINAL_ONLY and not finished:
                return None
            completion = state.completion(kind)
            if (
                kind is not RequestOutputKind.FINAL_ONLY
                and not finished
                and not (
                    completion.delta or completion.token_ids or state.has_new_prompt_logprobs(kind)
                )
            ):
                return None
            return self._request_output(state.request_id, state, [completion], finished)
        finished = parent.finished
        if finished:
            self.parents.pop(parent.request_id, None)
        if kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            children = [parent.children[i].completion(kind) for i in sorted(parent.children)]
        elif kind is RequestOutputKind.DELTA:
            children = [s.completion(kind) for s in delta_children or [state]]
        else:
            children = [parent.children[i].completion(kind) for i in sorted(parent.children)]
        return self._request_output(parent.request_id, state, children, finished)

    @staticmethod
    def _request_output(
        rid: str, state: RequestState, completions: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=rid,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            # (each child of an n > 1 request has the prompt's: the first one's go out)
            prompt_logprobs=state.take_prompt_logprobs(state.params.output_kind)
            if state.parent is None or state.index == 0
            else None,
            num_cached_tokens=state.num_cached_tokens,
            metrics=dict(state.metrics),
        )
