"""Per-request output collectors for streaming consumers (AsyncLLM's generators)."""

from __future__ import annotations

import asyncio

from asyncllm.aio import EventLike
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import RequestOutputKind


def merge_delta(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
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
    if new.prompt_logprobs is not None:  # DELTA: each position is sent once
        pending.prompt_logprobs = (pending.prompt_logprobs or []) + new.prompt_logprobs
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    pending.metrics = new.metrics
    return pending


class RequestOutputCollector:
    """Holds what a request's generator has not consumed yet: at most one output, into
    which later ones are merged, so memory stays bounded whatever the consumer's pace."""

    def __init__(self, kind: RequestOutputKind, ready: EventLike | None = None) -> None:
        self.kind = kind
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = ready if ready is not None else asyncio.Event()  # (or trio's: aio.Flag)

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
            self.output = merge_delta(self.output, out)
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
