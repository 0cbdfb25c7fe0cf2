"""A launched step and its results on their way to the host (async scheduling).

`ModelRunner.execute_model_async` returns a `StepResult` before its tokens are known;
the next step may be launched before `result()` is called. Results are applied to the
persistent batch in launch order (`StepsInFlight`), each once, and only to requests
still in it (a row may have changed hands meanwhile).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.step_io import ModelRunnerOutput, TokenLogprobs
from asyncllm.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class PendingLogprobs:
    """A request's prompt logprobs on their way to the host (`step_sampler.to_host`)."""

    ids: torch.Tensor  # [positions, 1 + n] int64
    logprobs: torch.Tensor  # [positions, 1 + n] float32
    ranks: torch.Tensor  # [positions] int64

    def read(self) -> TokenLogprobs:
        """Once the copies have run (the step's event)."""
        return TokenLogprobs(self.ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


@dataclass
class SampledGroup:
    """Requests sampled together, and their results on their way to the host."""

    states: list[CachedRequestState]
    rows: np.ndarray
    tokens: torch.Tensor  # [n + draft rows] int64, host
    top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # ids, logprobs, ranks
    # Requests verifying drafts: (index into states, its drafts); their draft positions'
    # rows follow the n first ones, in this order (see step_inputs.py).
    spec: list[tuple[int, list[int]]] | None = None
    # Counts a row's accepted drafts for its penalties (SamplingState.record_tokens).
    record: Callable[[int, list[int]], None] | None = None

    def accepted(self, tokens: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Per request verifying drafts (index into states): its new tokens and the rows
        they were sampled at. Each position's token is a sample of the model's
        distribution there (argmax for greedy requests); the drafts are kept while they
        equal those samples, then the first sample that differs (or, all kept, the one
        after the last draft) ends the list. A draft is so kept with the probability the
        model gives it, and a position that rejects one yields a sample of the model's
        distribution without it: rejection sampling against a draft that proposes one
        token, which keeps the output distribution exact."""
        out = {}
        o = len(self.states)
        for k, drafts in self.spec or ():
            rows = [k, *range(o, o + len(drafts))]
            o += len(drafts)
            new = []
            for j, row in enumerate(rows):
                new.append(tokens[row])
                if j == len(drafts) or tokens[row] != drafts[j]:
                    break
            out[k] = (new, rows[: len(new)])
        return out


class StepsInFlight:
    """The launched steps whose results are not applied yet, oldest first."""

    def __init__(self) -> None:
        self._steps: deque[StepResult] = deque()

    def __bool__(self) -> bool:
        return bool(self._steps)

    def append(self, result: StepResult) -> None:
        self._steps.append(result)

    def last(self) -> StepResult:
        return self._steps[-1]

    def apply_through(self, result: StepResult | None) -> None:
        """Applies the results in flight, oldest first, up to `result` (None: all)."""
        while self._steps:
            r = self._steps[0]
            r.apply()  # (interrupted, it stays in flight: a later call applies it)
            self._steps.popleft()
            if r is result:
                return

    def apply_before(self, result: StepResult) -> None:
        """Applies the results in flight launched before `result` (a split step's own
        is in flight while it is sampled: applied now, it would have no tokens)."""
        while self._steps and self._steps[0] is not result:
            self._steps[0].apply()
            self._steps.popleft()


class StepResult:
    """A launched step. `result()` waits for its tokens (and the steps launched before
    it), applies them to the persistent batch once, and returns the step's output."""

    def __init__(self, in_flight: StepsInFlight, batch: InputBatch, failed: dict[str, str]) -> None:
        self._in_flight = in_flight
        self._batch = batch
        self._groups: list[SampledGroup] = []
        self._done: torch.cuda.Event | None = None
        self._output: ModelRunnerOutput | None = None
        self._failed = failed
        self._prompt_logprobs: dict[str, PendingLogprobs] = {}
        # Set while the step's sampling waits for its grammar bitmask: queues it.
        self.finish: Callable[[], None] | None = None

    def sampled(
        self,
        groups: list[SampledGroup],
        failed: dict[str, str],
        prompt_logprobs: dict[str, PendingLogprobs],
        done: torch.cuda.Event | None,
    ) -> None:
        """The step's sampling is queued: its results, the requests that failed in it,
        and the event after which the copies to the host have run (None on the CPU)."""
        self._failed.update(failed)
        self._groups, self._prompt_logprobs = groups, prompt_logprobs
        self._done = done

    def finish_launch(self) -> None:
        """Queues the sampling of a step launched with `grammar_bitmask_later`, once the
        scheduler has filled its bitmask; nothing for any other step."""
        if self.finish is not None:
            self.finish()

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._in_flight.apply_through(self)
        assert self._output is not None
        return self._output

    def apply(self) -> None:
        if self._output is not None:
            return
        self.finish_launch()  # (a step is always sampled before its results are read)
        if self._done is not None:
            self._done.synchronize()
        # Everything is read to the host first (prompt logprobs may take milliseconds):
        # an interrupt meanwhile leaves the batch as it was, and the step in flight.
        prompt_logprobs = {rid: p.read() for rid, p in self._prompt_logprobs.items()}
        sampled, logprobs, takes, extras = self._read_groups()
        output = ModelRunnerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed=self._failed,
        )
        for take in takes:
            self._batch.take_sampled_tokens(*take)
        for state, tokens, record in extras:
            self._batch.append_tokens(state, tokens)
            if record is not None:
                record(state.row, tokens)
        self._output = output
        self._groups = []

    def _read_groups(
        self,
    ) -> tuple[
        dict[str, list[int]],
        dict[str, TokenLogprobs],
        list[tuple[list[CachedRequestState], np.ndarray, list[int]]],
        list[tuple[CachedRequestState, list[int], Callable[[int, list[int]], None] | None]],
    ]:
        """The sampled tokens and logprobs by request, and what to append to the
        persistent batch: the tokens of the requests still in it (one each), then the
        accepted drafts of those that verified some."""
        requests = self._batch.requests
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        takes = []
        extras = []
        for g in self._groups:
            tokens = g.tokens.tolist()
            states = g.states
            ids = [s.req_id for s in states]
            n = len(states)
            sampled.update(zip(ids, [[t] for t in tokens[:n]]))
            spec = g.accepted(tokens) if g.spec else {}
            for k, (new, _) in spec.items():
                sampled[ids[k]] = new
            if g.top is not None:  # (the sampler computes them when any row wants them)
                top_ids, lps, ranks = (t.tolist() for t in g.top)
                for k, state in enumerate(states):
                    want = state.sampling_params.logprobs
                    if want is not None:
                        at = spec[k][1] if k in spec else [k]
                        logprobs[state.req_id] = TokenLogprobs(
                            [top_ids[r][: 1 + want] for r in at],
                            [lps[r][: 1 + want] for r in at],
                            [ranks[r] for r in at],
                        )
            live = [requests.get(rid) is s for rid, s in zip(ids, states)]
            if all(live):
                takes.append((states, g.rows, tokens[:n]))
            elif any(live):  # (some were dropped meanwhile: their rows are not theirs now)
                keep = np.flatnonzero(live)
                takes.append(([states[k] for k in keep], g.rows[keep], [tokens[k] for k in keep]))
            for k, (new, _) in spec.items():
                if live[k] and len(new) > 1:  # (the first went with the others)
                    extras.append((states[k], new[1:], g.record))
        return sampled, logprobs, takes, extras
