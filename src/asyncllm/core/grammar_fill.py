"""The scheduler's structured-output work: one object the scheduler owns.

A constrained request waits here while its grammar compiles (`compiling`), then joins
the scheduler's waiting queue. Each step that samples a constrained request gets a row
(and one per draft it verifies: the grammar's mask after the drafts before it; a draft
its grammar refuses is rejected by its own row's mask, and the rows after it allow
every token) of a grammar bitmask (one of the structured manager's two shared buffers, named in
`SchedulerOutput.grammar_buffer` by index): filled at once when every matcher has seen
its request's tokens, or later (`masks_due`, `plan_grammar_fill`) when a token is still
in flight. The tokens the scheduler keeps (`note_kept`) are accepted by the matchers just
before the next fill, in the grammar process.

What the scheduler gives it: its `requests` (by id, for the requests to end when the
grammar process is lost) and `fail(req, kind, why)`, which ends a request with an error
output; the steps in flight are handed in as their records (see `Scheduler`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

from asyncllm.config import SchedulerConfig
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.step_plan import Scheduled
from asyncllm.messages import ErrorKind
from asyncllm.structured.grammar_process import GrammarProcessError

if TYPE_CHECKING:
    from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput
    from asyncllm.structured.manager import (
        Accepts,
        FillJob,
        Rows,
        StructuredOutputManager,
        StructuredRequest,
    )


def structured_rows(config: SchedulerConfig) -> int:
    """The most bitmask rows a step needs: one per request, and one per draft of the
    requests that draft (fewer than the speculation limit at once)."""
    spec, rows = config.speculative, config.max_num_seqs
    if spec is None:
        return rows
    return rows + min(spec.disable_by_batch_size - 1, rows) * spec.num_speculative_tokens


class GrammarFill:
    """The grammar state of the scheduler: requests compiling, bitmasks still to fill,
    tokens the matchers are still to accept, and steps whose tokens went ahead."""

    def __init__(
        self,
        structured: StructuredOutputManager | None,
        requests: dict[str, Request],
        fail: Callable[[Request, ErrorKind, str], None],
    ) -> None:
        self.structured = structured
        self._requests = requests  # (the scheduler's own dict, never rebound)
        self._fail = fail
        self.compiling: list[Request] = []  # waiting for their grammars, not yet queued
        # Steps whose grammar bitmask is still to fill (see `masks_due`): their
        # constrained requests, by bitmask row, and the bitmask.
        self._masks_due: dict[int, tuple[list[Request], Any]] = {}
        # Tokens kept since the last fill, for the matchers to accept first (see
        # `_fill_masks`).
        self._accepts: Accepts = []
        # Steps whose tokens were queued for the matchers before their results were
        # applied (`plan_grammar_fill(ahead=...)`), with the requests (by `id`) whose
        # tokens went: their update takes none of those.
        self._accepted_ahead: dict[int, set[int]] = {}

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar (none without a manager)."""
        return self.structured.stop_token_ids if self.structured is not None else frozenset()

    # -- requests in -----------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Starts the compilation of a constrained request's grammar; it waits in
        `compiling` until `take_compiled` queues it. ValueError without a manager."""
        if self.structured is None:
            raise ValueError("structured_outputs are not available in this engine")
        so = request.sampling_params.structured_outputs
        assert so is not None
        request.structured = self.structured.request(so)
        self.compiling.append(request)

    def take_compiled(self, wait: bool) -> list[Request]:
        """The requests whose grammars are ready, taken out of `compiling` (in order);
        those whose grammars failed are ended. With `wait` (nothing else to schedule),
        waits for the first one."""
        if wait and not any(r.structured.future.done() for r in self.compiling):
            futures_wait([r.structured.future for r in self.compiling], return_when=FIRST_COMPLETED)
        still, ready, failed = [], [], []
        for req in self.compiling:
            try:
                done = req.structured.ready()
            except GrammarProcessError as e:  # (its matcher could not be made)
                self.process_lost(e)
                failed.append((req, str(e)))
                continue
            if not done:
                still.append(req)
            elif (error := req.structured.error()) is not None:
                failed.append((req, error))
            else:
                ready.append(req)
        self.compiling = still
        for req, error in failed:
            self._fail(req, ErrorKind.INVALID, f"its structured output cannot be compiled: {error}")
        return ready

    def forget(self, ended: set[int]) -> None:
        """Drops the requests (by `id()`) that ended while compiling."""
        if self.compiling:
            self.compiling = [r for r in self.compiling if id(r) not in ended]

    # -- a step's bitmask ------------------------------------------------------------

    def plan_masks(self, out: SchedulerOutput, structured: list[Request], lagging: bool) -> None:
        """Gives the step `out` a bitmask for its constrained requests (by row, in
        batch order), then one row per draft of those that verify drafts (in the same
        order: `SchedulerOutput.grammar_rows`): filled now, or by `plan_grammar_fill`
        where `lagging` (a matcher has yet to see a token in flight)."""
        assert self.structured is not None
        out.structured_req_ids = [r.request_id for r in structured]
        out.grammar_buffer, bitmask = self.structured.take_bitmask(out.grammar_rows()[0])
        if lagging:
            self._masks_due[id(out)] = (structured, bitmask)
        else:
            self._fill_masks(out, structured, bitmask)

    def drop(self, sched: SchedulerOutput) -> None:
        """Forgets a step that will never run (its bitmask is not filled)."""
        self._masks_due.pop(id(sched), None)

    def masks_due(self, sched: SchedulerOutput) -> bool:
        """Whether `sched`'s grammar bitmask waits for `plan_grammar_fill`: one of its
        constrained requests samples after a token still in flight, which its matcher
        must accept first. The step's results (`update_from_output`) of every step in
        flight must be applied before it is filled, and it before `sched` runs."""
        return id(sched) in self._masks_due

    def plan_grammar_fill(
        self,
        sched: SchedulerOutput,
        ahead: SchedulerOutput | None,
        record: list[Scheduled] | None,
        device: bool,
    ) -> FillJob | None:
        """`Scheduler.plan_grammar_fill`, given the scheduler's record of the
        step in flight `ahead` (None: none, or no longer in flight)."""
        due = self._masks_due.pop(id(sched), None)
        if due is None:
            return None
        structured, bitmask = due
        accepts = self.ahead_accepts(ahead, record)
        return self._fill_masks(
            sched, structured, bitmask, wait=False, ahead=accepts, device=device
        )

    def ahead_accepts(
        self, ahead: SchedulerOutput | None, record: list[Scheduled] | None
    ) -> list[tuple[Request, StructuredRequest]]:
        """The constrained requests of the step in flight `ahead` (`record`, its
        scheduler's record) whose tokens its update will keep, as far as is known before
        it has run (`give_grammar_tokens` drops those the runner failed or that ended
        since), with their constraints; the step is then marked as sent ahead. Not
        those that verify drafts in it (their tokens are several, and they are not in
        the step being filled: each waits for its verification): their update queues
        their tokens, as usual."""
        if ahead is None or record is None or self.structured is None:
            return []
        if id(ahead) in self._accepted_ahead:
            return []  # (sent ahead already: a device's hand-over that went on)
        running = RequestStatus.RUNNING
        verifying = ahead.scheduled_spec_decode_tokens
        accepts = [
            (req, req.structured)
            for req, _, samples, preemptions in record
            if samples
            and req.structured is not None
            and req.status == running
            and req.num_preemptions == preemptions
            and req.request_id not in verifying
        ]
        self._accepted_ahead[id(ahead)] = {id(req) for req, _ in accepts}
        return accepts

    def accept_when_applied(self, sched: SchedulerOutput) -> None:
        """The step's tokens go to its matchers when it is applied after all: the fill
        `plan_grammar_fill` sent ahead of them never got them (its launch failed)."""
        self._accepted_ahead.pop(id(sched), None)

    def take_accepted_ahead(self, sched: SchedulerOutput) -> set[int]:
        """The requests (by `id`) whose tokens of the step went ahead (its update then
        queues none of theirs for the matchers); forgets the step."""
        return self._accepted_ahead.pop(id(sched), set())

    @property
    def has_accepted_ahead(self) -> bool:
        """Whether a step's tokens went ahead and its update is still to come."""
        return bool(self._accepted_ahead)

    def give_grammar_tokens(self, job: FillJob | None, runner: ModelRunnerOutput | None) -> None:
        """Sends `job` (`plan_grammar_fill`'s) the tokens its step ahead sampled
        (`runner`, its output; None: it had none), up to the first that ends a grammar;
        the fill then runs."""
        if job is not None and runner is None:
            job.release_tokens()  # (a device job: its step did not launch)
        if job is None or job.ahead_keys is None:
            return
        running = RequestStatus.RUNNING
        ends = self.stop_token_ids
        tokens: list[list[int]] = []
        for req in job.ahead_keys:
            rid = req.request_id
            toks: list[int] = []
            if runner is not None and req.status == running and rid not in runner.failed:
                for token in runner.sampled_token_ids.get(rid, ()):
                    toks.append(token)
                    if token in ends:
                        break
            tokens.append(toks)
        job.give_tokens(tokens)

    def _fill_masks(
        self,
        sched: SchedulerOutput,
        structured: list[Request],
        bitmask: Any,
        wait: bool = True,
        ahead: list[tuple[Request, StructuredRequest]] | None = None,
        device: bool = False,
    ) -> FillJob | None:
        """The matchers accept the tokens kept since the last fill (then those of
        `ahead`, to come: see `plan_grammar_fill`), then the bitmask's rows are filled,
        in the grammar process; waited for here (`wait`), or by `finish_fill`. The
        requests not running get all-allowing rows. A device job's number and the ids
        of its requests ahead go into `sched` (`grammar_seq`, `grammar_ahead_req_ids`)."""
        assert self.structured is not None  # (it made their constraints)
        accepts, self._accepts = self._accepts, []
        running = RequestStatus.RUNNING
        _, firsts = sched.grammar_rows()  # (the draft rows of those that verify drafts)
        rows: Rows = []
        for row, req in enumerate(structured):
            drafts = sched.scheduled_spec_decode_tokens.get(req.request_id, [])
            first = firsts.get(req.request_id, 0)
            if req.status == running:
                rows.append((row, req.structured, drafts, first))
            else:  # (allows all: its tokens are dropped)
                bitmask.numpy()[row] = -1
                bitmask.numpy()[first : first + len(drafts)] = -1
        try:
            job = self.structured.start_fill(bitmask, rows, accepts, ahead, device)
        except GrammarProcessError as e:
            bitmask.fill_(-1)  # (allows all: the tokens are dropped)
            self.process_lost(e)
            return None
        if job.seq:
            sched.grammar_seq = job.seq
            sched.grammar_ahead_req_ids = [req.request_id for req, _ in ahead or ()]
        if wait:
            self.finish_fill(job)
            return None
        return job

    def finish_fill(self, job: FillJob) -> None:
        """Waits for a fill `plan_grammar_fill` started, and ends the requests whose
        grammar refused one of the tokens it accepted (or, if the grammar process was
        lost, every request whose matcher it held)."""
        try:
            refused = job.wait()
        except GrammarProcessError as e:  # (the step's bitmask now allows every token)
            if not job.stale:  # (a stale job's process was lost, and dealt with, before)
                self.process_lost(e)
            return
        for req in refused:  # (the mask allows only tokens the grammar accepts: a bug)
            if not req.is_finished:
                self._fail(req, ErrorKind.FAILED, "a sampled token breaks its grammar")

    # -- tokens kept, matchers lost ----------------------------------------------------

    def note_kept(self, req: Request, token: int) -> None:
        """`req` (constrained) kept `token`: its matcher accepts it just before the next
        fill, with the others' (see `_fill_masks`)."""
        self._accepts.append((req, req.structured, token))

    def process_lost(self, error: GrammarProcessError) -> None:
        """Ends every unfinished request whose matcher lived in the grammar process, with
        the error; the others go on, and the next matcher starts a new process."""
        assert self.structured is not None
        self.structured.reset()
        self._accepts = []  # (all for matchers of that process)
        why = f"its grammar's matcher was lost: {error}"
        for req in list(self._requests.values()):
            if req.structured is not None and req.structured.matcher_id is not None:
                if not req.is_finished:
                    self._fail(req, ErrorKind.FAILED, why)

    def rebuild_matcher(self, req: Request) -> None:
        """Gives `req` a new matcher that accepts the tokens it kept, with the next fill
        (the old one, and the accepts still queued for it, are let go)."""
        assert self.structured is not None and req.structured is not None
        self._accepts = [a for a in self._accepts if a[0] is not req]
        try:
            req.structured = structured = self.structured.renew(req.structured)
        except GrammarProcessError as e:  # (its matcher could not be made: it ends)
            self.process_lost(e)
            return
        self._accepts.extend((req, structured, t) for t in req.output_token_ids)
