"""The engine core's side of structured outputs (after vLLM v1's StructuredOutputManager).

Grammars compile in a small thread pool, cached by key, so the step loop never waits for
one while it has other work; a request waits in the scheduler until its grammar is
ready, and a grammar that fails ends only that request. Each request gets its own
matcher, in the grammar process (grammar_process.py: out of this process's GIL): before
a step samples it, its matcher accepts the tokens the request kept, then fills its row
of the token bitmask (bit t of a row set: token t may come next), which the model runner
reads from memory the two processes share and applies to the logits on the device.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import torch

from asyncllm.envs import grammar_threads
from asyncllm.hf_tokenizer import load_hf_tokenizer
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, GrammarSync, flag_reached
from asyncllm.structured import grammar_process
from asyncllm.structured.grammar import GrammarKey, build_grammar, grammar_key, xgrammar_module
from asyncllm.structured.grammar_process import (
    START_TIMEOUT_S,
    GrammarProcess,
    GrammarProcessError,
    shared_layout,
)

logger = logging.getLogger(__name__)


WATCH_S = 0.5  # (how often the device steps' watchdog looks; see `_watch`)
# Compiled grammars kept (by key, the least recently asked for dropped first), here and
# in the grammar process: a server whose clients send a schema each would grow without
# bound (~0.3 MB a small schema). A matcher outlives its grammar's eviction.
GRAMMAR_CACHE = 128


class StructuredRequest:
    """One request's constraint: its grammar (compiling, then compiled) and, once it is
    compiled, its matcher in the grammar process (`matcher_id`; let go with this)."""

    __slots__ = ("future", "key", "matcher_id", "_manager", "__weakref__")

    def __init__(self, future: Future[Any], key: GrammarKey, manager: StructuredOutputManager):
        self.future = future
        self.key = key
        self.matcher_id: int | None = None
        self._manager = manager

    def ready(self) -> bool:
        """Whether the grammar is compiled (its matcher made) or failed."""
        if self.matcher_id is None and self.future.done() and self.future.exception() is None:
            self.matcher_id = self._manager._new_matcher(self)
        return self.future.done()

    def error(self) -> str | None:
        e = self.future.exception() if self.future.done() else None
        return None if e is None else f"{type(e).__name__}: {e}"


# Tokens matchers are still to accept, (key, request, token), oldest first; the key (the
# scheduler's request) comes back with each token its grammar refused.
Accepts = list[tuple[Any, StructuredRequest, int]]
# Bitmask rows to fill: (row, request), or (row, request, drafts, first draft row): the
# row after each draft is filled too, as if the draft were accepted (a draft the grammar
# refuses leaves its rows and those after it allowing every token); the matcher is then
# back where it was.
Rows = list[tuple[int, StructuredRequest] | tuple[int, StructuredRequest, list[int], int]]


class FillJob:
    """A step's accepts and bitmask fill in the grammar process; `wait()` returns once
    they are done, with the keys of the tokens the grammars refused, or raises
    GrammarProcessError (the process is lost; the bitmask then allows every token).
    A job started with `ahead` accepts (tokens still to come) runs once `give_tokens`
    has sent them; a device job (`seq` set) gets them from the device, and the device
    waits for its bitmask (see `start_fill`)."""

    __slots__ = (
        "_manager",
        "_keys",
        "_bitmask",
        "_refused",
        "_error",
        "_done",
        "ahead_keys",
        "_sent_to",
        "seq",
        "sent_at",
        "tokens_sent",
    )

    def __init__(
        self,
        manager: StructuredOutputManager | None,
        keys: list[Any],
        bitmask: torch.Tensor | None = None,
        ahead_keys: list[Any] | None = None,
        seq: int = 0,
    ) -> None:
        self._manager, self._keys, self._bitmask = manager, keys, bitmask
        self.seq = seq  # (a device job's number; 0: a host job)
        self.sent_at = time.monotonic()
        self._refused: list[Any] = []
        self._error: BaseException | None = None
        self._done = manager is None
        # The keys of the accepts whose tokens are still to come (None: none are).
        self.ahead_keys = ahead_keys
        self.tokens_sent = False  # (`give_tokens` has sent them)
        # The grammar process it was sent to (see `stale`)
        self._sent_to = None if manager is None else manager._process

    @property
    def stale(self) -> bool:
        """Whether the process it was sent to is no longer the manager's: that loss was
        dealt with (`reset`, its requests ended), so its error is not news of the
        process the manager has now (perhaps a new one, with new requests)."""
        return self._manager is not None and self._manager._process is not self._sent_to

    def give_tokens(self, tokens: list[list[int]]) -> None:
        """The tokens of the `ahead` accepts, in their order (an empty list: that
        matcher takes none); the grammar process then runs the step."""
        if self._done:  # (failed: the grammar process was lost meanwhile)
            return
        keys = self.ahead_keys
        if keys is None:
            raise RuntimeError("this fill job does not wait for tokens")
        if len(tokens) != len(keys):
            raise ValueError(f"{len(tokens)} token lists for {len(keys)} accepts")
        self.ahead_keys = None
        assert self._manager is not None
        for key, toks in zip(keys, tokens):
            self._keys.extend([key] * len(toks))
        self._manager._send_tokens(self, tokens)
        self.tokens_sent = True

    def release_tokens(self) -> None:
        """A device job whose tokens the device will not give (its step did not launch):
        it takes none (the grammar process waits for them, and every later step behind
        it)."""
        if self.seq and not self._done:
            assert self._manager is not None
            self._manager._release_tokens(self.seq)

    def _fail(self, error: BaseException) -> None:
        """Ends the job with `error`; its bitmask's rows (perhaps half written, or never)
        then allow every token, and a device waiting for them goes on."""
        self._done, self._error, self.ahead_keys = True, error, None
        if self._bitmask is not None:
            self._bitmask.fill_(-1)
        if self.seq:
            assert self._manager is not None
            self._manager._release_mask(self.seq)

    def wait(self) -> list[Any]:
        if self.ahead_keys is not None:
            raise RuntimeError("a fill job waiting for its tokens cannot be waited for")
        if not self._done:
            assert self._manager is not None
            self._manager._answer(self)
        if self._error is not None:
            raise self._error
        return self._refused


class _Shared:
    """The two bitmask buffers, a device step's tokens and its flags, in a memory-mapped
    file the grammar process maps too (registered with CUDA as pinned, mapped memory
    where the runner copies from it; `device_steps`: the device can wait for the flags
    and write them, see asyncllm_kernels/stream_ops.py)."""

    def __init__(self, rows: int, words: int, pin: bool) -> None:
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.file: IO[bytes] = tempfile.TemporaryFile(dir=where)  # (no name: nothing leaks)
        tokens_at, flags_at, size = shared_layout(rows, words)
        self.file.truncate(size)
        self.map = mmap.mmap(self.file.fileno(), size)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        both = whole[:tokens_at].view(torch.int32).view(2, rows, words)
        self.buffers = [both[0], both[1]]
        self.tokens = whole[tokens_at:flags_at].view(torch.int64)
        self.flags = whole[flags_at:].view(torch.int32)
        self.flags_np = self.flags.numpy().view("uint32")
        self.flags_np[:] = 1  # (the step numbers start at 2)
        self.pinned = self.device_steps = False
        if pin:
            from asyncllm_kernels import stream_ops

            rc = torch.cuda.cudart().cudaHostRegister(
                whole.data_ptr(), size, stream_ops.REGISTER_MAPPED
            )
            self.pinned = int(rc) == 0
            if not self.pinned:
                logger.warning("the bitmask buffers could not be pinned (error %s)", rc)
            else:
                self.device_steps = stream_ops.usable(self.flags[TOKENS_FLAG : TOKENS_FLAG + 1])
                if not self.device_steps:
                    logger.warning("the device cannot wait for the grammar's flags")

    def close(self) -> None:
        # (a device still waiting for a flag goes on: every number up to 2**30 ahead)
        self.flags_np[:] = (self.flags_np.astype("int64") + (1 << 30)) & 0xFFFFFFFF
        if self.pinned:
            torch.cuda.synchronize()  # (the copies queued from and to this memory run first)
            torch.cuda.cudart().cudaHostUnregister(self.buffers[0].data_ptr())
            self.pinned = False
        self.buffers = []
        self.tokens = self.flags = torch.empty(0)
        self.flags_np = self.flags_np[:0]
        try:
            self.map.close()
        except BufferError:  # (a view of a buffer is still held: the map goes with it)
            pass
        self.file.close()


class GrammarBuffers:
    """A model runner's handle on the structured manager's shared memory (step_io's
    `GrammarMemory`), handed to it at start-up: it looks up what a SchedulerOutput names
    by index (`grammar_buffer`, `grammar_seq`), so only plain data goes with each step.
    The views are made once per (buffer, rows): no copy, and no torch op per step. The
    memory is mapped at the first use (the manager's first bitmask or matcher)."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self._manager = manager
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def bitmask(self, index: int, rows: int) -> torch.Tensor:
        view = self._views.get((index, rows))
        if view is None:
            view = self._views[index, rows] = self._manager._get_shared().buffers[index][:rows]
        return view

    def sync(self, seq: int, ahead_req_ids: list[str]) -> GrammarSync:
        tokens, flags = self._manager.device_buffers()
        return GrammarSync(seq, ahead_req_ids, tokens, flags)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: str | None,
        vocab_size: int,
        pin_memory: bool = False,
        max_rows: int = 256,
    ) -> None:
        self.tokenizer_path = tokenizer
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory  # (CUDA: the runner copies the bitmask to the device as it is)
        self.max_rows = max_rows  # (the scheduler's max_num_seqs: a step's bitmask rows at most)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="asyncllm-grammar")
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # (the grammar process's start)
        self._closed = False
        self._compiler: Any = None
        self._tokenizer_info: Any = None
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._stop_token_ids: frozenset[int] = frozenset()
        # The bitmask buffers (made at the first take_bitmask or matcher), taken in turn.
        self._shared: _Shared | None = None
        self._next_bitmask = 0
        # The grammar process (made with the first matcher), what it has been sent
        self._process: GrammarProcess | None = None
        self._grammar_ids: dict[GrammarKey, int] = {}
        self._next_grammar = 0
        self._dropped: list[int] = []  # grammars evicted from the cache, to send
        self._next_matcher = 0
        self._new_matchers: list[list[int]] = []  # [matcher id, grammar id], to send
        # Matchers let go, to send: one list for good (each request's finalizer appends
        # to it, on whatever thread drops the request; `_take_freed` drains it in place).
        self._freed: list[int] = []
        self._pending: deque[FillJob] = deque()  # the steps sent whose answers are unread
        self._seq = 1  # the last device step's number (the flags start at 1)
        self._watchdog: threading.Thread | None = None  # (started by the first device job)
        self._stop_watching = threading.Event()
        # Waits until the copy that read bitmask buffer k for its last step has run (the
        # engine core sets it to its executor's; None: nothing copies asynchronously).
        self.wait_bitmask_copied: Callable[[int], None] | None = None

    def _get_compiler(self) -> Any:
        with self._lock:  # (built once, by the first compilation)
            if self._compiler is None:
                if self.tokenizer_path is None:
                    raise ValueError("structured outputs need the tokenizer (skip_tokenizer_init)")
                xgr = xgrammar_module()
                tok = load_hf_tokenizer(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
                self._stop_token_ids = frozenset(info.stop_token_ids)
                self._tokenizer_info = info
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        compiled = self._get_compiler().compile_grammar(build_grammar(key))
        self._get_process()  # (its start, ~1-3 s, is the first grammar's, not the step's)
        return compiled

    def request(self, so: StructuredOutputsParams) -> StructuredRequest:
        """A constraint for a new request; its grammar compiles in the background (once
        per key: a failed one is tried again by the next request that asks)."""
        key = grammar_key(so)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._cache[key] = self._pool.submit(self._compile, key)
        self._cache.move_to_end(key)
        while len(self._cache) > GRAMMAR_CACHE:
            old, _ = self._cache.popitem(last=False)
            gid = self._grammar_ids.pop(old, None)
            if gid is not None:  # (its matchers keep it; new ones are made from a new copy)
                self._dropped.append(gid)
        return StructuredRequest(fut, key, self)

    def renew(self, old: StructuredRequest) -> StructuredRequest:
        """A new constraint on `old`'s compiled grammar, its matcher at the start (made
        now, sent with the next step); `old`'s matcher goes once `old` is let go."""
        new = StructuredRequest(old.future, old.key, self)
        new.ready()
        return new

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar: a matcher is terminated once it accepts one
        (set once a grammar has compiled)."""
        return self._stop_token_ids

    # -- the grammar process ---------------------------------------------------------

    def _words(self) -> int:
        return -(-self.vocab_size // 32)

    def _get_shared(self) -> _Shared:
        with self._lock:
            if self._shared is None:
                self._shared = _Shared(self.max_rows, self._words(), self.pin_memory)
            return self._shared

    def _get_process(self) -> GrammarProcess:
        """The grammar process, started by the first compilation (in the pool's thread;
        the step's thread only sees requests whose grammar is compiled)."""
        with self._start_lock:
            if self._closed:
                raise RuntimeError("the structured output manager has shut down")
            if self._process is None:
                shared = self._get_shared()
                with tempfile.TemporaryFile() as info:  # (the child reads it by its fd)
                    info.write(self._tokenizer_info.serialize_json().encode())
                    info.flush()
                    process = GrammarProcess(
                        info.fileno(),
                        shared.file.fileno(),
                        self.max_rows,
                        self._words(),
                        grammar_threads(),
                    )
                    try:
                        process.answer(START_TIMEOUT_S)  # (started: read the file, mapped ours)
                    except RuntimeError:
                        process.close()
                        raise
                self._process = process  # (only now: no step reads its first answer)
            return self._process

    def _new_matcher(self, req: StructuredRequest) -> int:
        """A matcher for `req`'s compiled grammar, made in the grammar process with the
        next message; the grammar is sent once per key."""
        process = self._get_process()
        gid = self._grammar_ids.get(req.key)
        if gid is None:
            gid = self._next_grammar
            self._next_grammar += 1
            process.send(["grammar", gid, req.future.result().serialize_json()])
            if self._cache.get(req.key) is req.future:
                self._grammar_ids[req.key] = gid
            else:  # (its key left the cache while it compiled: this matcher's, then dropped)
                self._dropped.append(gid)
        mid = self._next_matcher
        self._next_matcher += 1
        self._new_matchers.append([mid, gid])
        weakref.finalize(req, self._freed.append, mid)
        return mid

    def _take_freed(self) -> list[int]:
        """The matchers let go since the last call (a finalizer may append meanwhile:
        only what was copied is removed)."""
        freed = self._freed[:]
        del self._freed[: len(freed)]
        return freed

    def _answer(self, job: FillJob) -> None:
        """Reads the answers up to `job`'s (the steps are answered in order). If one
        fails (the process ended, or an answer timed out: a late one would then be
        read as the next step's), every step sent fails with it; the caller resets."""
        while not job._done:
            pending = self._pending[0]
            assert self._process is not None and pending.ahead_keys is None
            try:
                refused = self._process.answer()
            except GrammarProcessError as e:
                while self._pending:
                    self._pending.popleft()._fail(e)
                return
            # (only now: interrupted in the wait, the answer is still to read, its own)
            self._pending.popleft()
            pending._done = True
            pending._refused = [pending._keys[i] for i in refused]

    @property
    def device_steps(self) -> bool:
        """Whether fills can be device steps (`start_fill(device=True)`): the shared
        memory is pinned and the device can wait for its flags and write them."""
        return self._get_shared().device_steps

    def device_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A device job's shared tokens (int64, one per ahead matcher, in its order:
        the device writes them, -1 for none) and flags (int32: the device sets
        flags[TOKENS_FLAG] to the job's `seq` once the tokens are in, and waits for
        flags[MASK_FLAG] to reach it before it reads the bitmask)."""
        shared = self._get_shared()
        return shared.tokens, shared.flags

    def _release_tokens(self, seq: int) -> None:
        shared = self._shared
        if shared is not None:
            flags = shared.flags_np
            if not flag_reached(int(flags[TOKENS_FLAG]), seq):
                shared.tokens.fill_(-1)
                flags[TOKENS_FLAG] = seq

    def _release_mask(self, seq: int) -> None:
        shared = self._shared
        if shared is not None:
            flags = shared.flags_np
            if not flag_reached(int(flags[MASK_FLAG]), seq):
                flags[MASK_FLAG] = seq

    def _watch(self) -> None:
        """The device steps' watchdog. A device may wait for a fill's flag while the
        step's thread waits for the device (a pinned allocation, a sync for logits
        processors): if the grammar process then dies, or leaves a device job unanswered
        for STEP_TIMEOUT_S (it is killed), only this thread can let the device go. It
        opens the bitmasks of the unanswered device jobs to every token and sets their
        flag; the step's thread then finds the process lost and ends its requests."""
        while not self._stop_watching.wait(WATCH_S):
            with self._start_lock:
                process = self._process
                try:
                    jobs = [j for j in self._pending if j.seq and not j._done]
                except RuntimeError:  # (the deque changed meanwhile: next time)
                    continue
                if process is None or not jobs:
                    continue
                hung = time.monotonic() - jobs[0].sent_at > grammar_process.STEP_TIMEOUT_S
                if process.proc.poll() is None and not hung:
                    continue
                if hung:
                    process.proc.kill()
                for job in jobs:
                    if job._bitmask is not None:
                        job._bitmask.fill_(-1)
                self._release_mask(jobs[-1].seq)
            logger.warning("the grammar process was lost with device steps waiting: let go")

    def _send_tokens(self, job: FillJob, tokens: list[list[int]]) -> None:
        assert self._process is not None
        try:
            self._process.send(["tokens", tokens])
        except GrammarProcessError as e:  # (its answer, read in turn, is the error)
            logger.warning("%s", e)

    # -- a step's accepts and fill ---------------------------------------------------

    def start_fill(
        self,
        bitmask: torch.Tensor | None,
        rows: Rows,
        accepts: Accepts,
        ahead: list[tuple[Any, StructuredRequest]] | None = None,
        device: bool = False,
    ) -> FillJob:
        """Sends a step to the grammar process: the matchers accept `accepts` (in order),
        then the tokens of `ahead` ((key, request) pairs; the job's `give_tokens` sends
        them: the step waits for them there), then fill their rows of `bitmask` (one of
        `take_bitmask`'s) for `rows` (`Rows`; a row whose matcher a token ended allows
        every token), while the caller goes on. The caller must leave
        the bitmask and these requests alone until `wait()`, which gives the refused
        keys. GrammarProcessError if the process is lost.

        A `device` step (where `device_steps`) gets the tokens of `ahead` from the
        device instead, one each, through `device_buffers`, and the job's
        number (`seq`) is what the device waits for before it reads the bitmask; if the
        job fails, the flag is set for it (the bitmask then allows every token)."""
        if not rows and not accepts and not ahead and not device:
            return FillJob(None, [])
        if any(job.ahead_keys is not None for job in self._pending):
            raise RuntimeError("a step was sent while an earlier one still waits for its tokens")
        process = self._get_process()
        if self._new_matchers or self._freed or self._dropped:
            new, self._new_matchers = self._new_matchers, []
            dropped, self._dropped = self._dropped, []
            process.send(["matchers", new, self._take_freed(), dropped])
        k = 0
        if rows:
            assert bitmask is not None and self._shared is not None
            k = [b.data_ptr() for b in self._shared.buffers].index(bitmask.data_ptr())
        msg = ["step", [[r.matcher_id, t] for _, r, t in accepts], k]
        msg.append([[row[0], row[1].matcher_id, *row[2:]] for row in rows])
        msg.append([r.matcher_id for _, r in ahead] if ahead else [])
        keys = [key for key, _, _ in accepts]
        if device:
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="asyncllm-grammar-watchdog", daemon=True
                )
                self._watchdog.start()
            self._seq = seq = self._seq % 0xFFFFFFFF + 1
            msg.append(seq)
            job = FillJob(self, keys + [key for key, _ in ahead or ()], bitmask, seq=seq)
        else:
            job = FillJob(self, keys, bitmask, [key for key, _ in ahead] if ahead else None)
        process.send(msg)
        self._pending.append(job)
        return job

    def reset(self) -> None:
        """Forgets the grammar process after it failed (and stops it) with every matcher
        it held, whose requests the caller ends; the next matcher starts another."""
        with self._start_lock:
            process, self._process = self._process, None
            if process is not None:
                process.close(kill=True)
            for job in self._pending:
                job._fail(GrammarProcessError("the grammar process was stopped"))
            self._pending.clear()
        self._grammar_ids.clear()
        self._new_matchers, self._dropped = [], []
        self._take_freed()  # (they lived in the process that is gone)

    def accept(self, accepts: Accepts) -> list[Any]:
        """Advances the matchers by `accepts`, in order, and waits; returns the keys of
        the tokens their grammar refused."""
        return self.start_fill(None, [], accepts).wait()

    def fill_bitmask(self, bitmask: torch.Tensor, rows: Rows) -> None:
        """Fills `bitmask`'s rows from their requests' matchers ((row, request) pairs),
        and waits. In the grammar process, split over its threads
        (ASYNCLLM_GRAMMAR_THREADS) where there are enough rows."""
        self.start_fill(bitmask, rows, []).wait()

    def take_bitmask(self, rows: int) -> tuple[int, torch.Tensor]:
        """A bitmask of `rows` rows for a step, its contents undefined until the fill
        writes every row: (its buffer's index, a view of it), one of two buffers the
        grammar process shares (pinned if `pin_memory`), taken in turn. A buffer is
        written again only once the copy that read it for its last step has run:
        `wait_bitmask_copied(index)` (the executor's, set by the engine core: the model
        runner records an event after its copy to the device) waits for it."""
        if rows > self.max_rows:
            raise ValueError(f"rows={rows} is more than the bitmask's max_rows={self.max_rows}")
        buffers = self._get_shared().buffers
        k = self._next_bitmask
        self._next_bitmask ^= 1
        if self.wait_bitmask_copied is not None:
            self.wait_bitmask_copied(k)  # (at depth 2 it has long run)
        return k, buffers[k][:rows]

    def memory(self) -> GrammarBuffers:
        """The worker side's handle on the shared memory (see `GrammarBuffers`)."""
        return GrammarBuffers(self)

    def shutdown(self) -> None:
        self._stop_watching.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for job in list(self._pending):
            if job.ahead_keys is not None:  # (no tokens will come: it accepts none)
                job.give_tokens([[] for _ in job.ahead_keys])
            job.release_tokens()
        if self._pending:
            self._answer(self._pending[-1])
        with self._start_lock:  # (a start under way ends first)
            self._closed = True
            if self._process is not None:
                self._process.close()
                self._process = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self.wait_bitmask_copied = None
