"""The grammar process: the engine core's grammar matchers live here, so that accepting a
step's tokens and filling the next step's token bitmask run beside the core's step
without sharing its GIL (a fill thread in the core paid a GIL hand-off per xgrammar
call, and its Python slowed the step's).

The core (`GrammarProcess`, used by StructuredOutputManager) compiles grammars itself and
sends each compiled grammar once, serialized; it tells the process which matcher each
request gets, and each step one message: the tokens the matchers accept, then the rows
to fill. A step may name matchers whose tokens are not known yet (those of the step
still on the device): the core sends it as soon as the step is scheduled, and the
tokens follow in a "tokens" message once they are in; the process resolves the step's
matchers meanwhile and runs it then (other messages may come between the two). On
CUDA such a step is a device step (its message carries its number, seq): the device
itself writes the tokens to the shared memory and sets a flag to seq; the process
looks at that flag between short naps, runs the step, then sets another flag to seq,
which the device waits for before it copies the bitmask and samples
(step_io.GrammarSync). The process fills rows of the two bitmask buffers it shares
with the core (a memory-mapped file the core opened, passed as a descriptor, as is the
tokenizer's information; a row whose matcher a stop token ended allows every token) and
answers the step with the positions of the tokens the grammars refused. A step's
accepts and fill are split over THREADS threads of the process (`StepThreads`).

Frames on the pipes: a 4-byte big-endian length, then msgpack. The child's stdin carries
the core's messages; its real stdout (stdout itself is pointed at stderr) carries one
answer once it has started and one per step, `["ok", refused]` or `["error", message]`
(the other messages have none: a failure there ends the process). EOF on stdin ends it.

    python -m asyncllm.structured.grammar_process INFO_FD BITMASK_FD ROWS WORDS THREADS
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import numpy as np

from asyncllm import envs
from asyncllm.step_io import FLAG_WORDS, MASK_FLAG, TOKENS_FLAG, flag_reached

_HEADER = 4
_LIVENESS_S = 1.0  # (how often a wait for an answer checks that the process lives)
# A thread of the step's fill gets at least this many rows (one row is ~5-20 µs of
# xgrammar; each thread costs a wake-up and its turn at the GIL around its calls: on the
# H200 host 64 rows filled fastest on 4 threads, and 16 rows on 2 were slower than on 1).
MIN_ROWS_PER_THREAD = 16
# The longest a step's answer may take (its fill is milliseconds), and the start's
# (importing xgrammar and torch on a loaded machine): past it the process counts as lost.
STEP_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send(fd: int, obj: Any) -> None:
    body = msgspec.msgpack.encode(obj)
    _write_all(fd, len(body).to_bytes(_HEADER, "big") + body)


def _recv(fd: int) -> Any:
    size = int.from_bytes(_read_exact(fd, _HEADER), "big")
    return msgspec.msgpack.decode(_read_exact(fd, size))


# The shared file: two bitmask buffers of `rows` x `words` int32, then `rows` int64 (the
# tokens of a device step, written by the device), then FLAG_WORDS uint32 (the flags of
# a device step, step_io's).
def shared_layout(rows: int, words: int) -> tuple[int, int, int]:
    """(offset of the tokens, offset of the flags, size) of the shared file."""
    tokens = 2 * rows * words * 4
    flags = tokens + rows * 8
    return tokens, flags, flags + FLAG_WORDS * 4


# -- the child -----------------------------------------------------------------------


def accept_tokens(matchers: list[Any], tokens: list[int], batch_accept: Any) -> list[int]:
    """Advances `matchers[i]` by `tokens[i]`, in order; the positions refused. One
    xgrammar call unless a matcher comes twice (then one by one, in order)."""
    if not matchers:
        return []
    if len({id(m) for m in matchers}) < len(matchers):
        return [i for i, (m, t) in enumerate(zip(matchers, tokens)) if not m.accept_token(t)]
    ok = batch_accept(matchers, tokens)
    if 0 not in ok:
        return []
    return [i for i, good in enumerate(list(ok)) if not good]


def raw_batch_accept(xgr: Any) -> Any:
    """xgrammar's batch accept, (matchers, tokens) -> their results (1 or True:
    accepted), straight from its core: the public wrapper turns the results into a list
    with one FFI call per row (~70 µs at 64)."""
    try:
        from xgrammar.base import _core

        raw = _core.BatchGrammarMatcher.batch_accept_token
    except (ImportError, AttributeError):  # (another layout: the public wrapper)
        return xgr.BatchGrammarMatcher.batch_accept_token
    return lambda matchers, tokens: raw([m._handle for m in matchers], tokens, False)


# A row to fill: (row, matcher, drafts, first draft row)
Fill = tuple[int, Any, list[int], int]


def allow_all(bitmask: Any, fill: Fill) -> None:
    """A fill's rows, its draft rows included, allow every token."""
    row, _, drafts, first = fill
    bitmask[row] = -1
    bitmask[first : first + len(drafts)] = -1


def fill_draft_rows(matcher: Any, drafts: list[int], bitmask: Any, first: int) -> None:
    """Row `first + j` of `bitmask`: the tokens `matcher` allows after drafts 0..j, as if
    it had accepted them. From a draft it refuses (or one that ends it) on, the rows
    allow every token: verification rejects that draft by its own row (filled before
    it), so what follows it is never kept. The matcher is then back where it was."""
    taken = 0
    for j, token in enumerate(drafts):
        if matcher.is_terminated() or not matcher.accept_token(token):
            bitmask[first + j : first + len(drafts)] = -1
            break
        taken += 1
        if matcher.is_terminated():
            bitmask[first + j] = -1
        else:
            matcher.fill_next_token_bitmask(bitmask, first + j)
    if taken:
        matcher.rollback(taken)


class StepThreads:
    """A step's accepts and bitmask fill on up to `threads` threads: this one and
    `threads - 1` made once, each woken by its own semaphore. Part i takes every k-th
    row of the fill (k parts, at least MIN_ROWS_PER_THREAD rows each) and the accepts of
    those rows' matchers, so no matcher is touched by two threads and each matcher takes
    its tokens in order before its row is filled. xgrammar gives up the GIL in its calls,
    so the parts run in parallel. (xgrammar's own BatchGrammarMatcher threads are not
    used: it starts a new pool on every call, which makes its cost erratic: on the H200
    host 666 µs for 64 rows but 3,309 µs for 16, against 707 and 291 here.)"""

    def __init__(
        self, threads: int, xgr: Any, stop_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self._stops = stop_token_ids  # (a matcher that accepts one may end: its row allows all)
        self.batchers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(threads)]
        self._batch_accept = raw_batch_accept(xgr)
        self._go = [threading.Semaphore(0) for _ in range(threads)]  # ([0]: this thread's, unused)
        self._done = threading.Semaphore(0)
        self._work: list[Any] = [None] * threads
        self._results: list[Any] = [None] * threads
        for i in range(1, threads):
            name = f"asyncllm-grammar-fill-{i}"
            threading.Thread(target=self._serve, args=(i,), name=name, daemon=True).start()

    def run(self, accepts: list[tuple[Any, int]], fills: list[Fill], bitmask: Any) -> list[int]:
        """Each matcher of `accepts` ((matcher, token), in order) takes its token, then
        each matcher of `fills` ((row, matcher, drafts, first draft row)) fills its row
        of `bitmask` (a row whose matcher a token of `accepts` ended allows every token:
        its request is over), and one row per draft (`fill_draft_rows`); the positions
        in `accepts` of the tokens refused, ascending. Raises what xgrammar raised (the
        parts that ran are done)."""
        k = min(len(self.batchers), max(1, len(fills) // MIN_ROWS_PER_THREAD))
        if k > 1 and len({id(f[1]) for f in fills}) < len(fills):
            k = 1  # (a matcher with two rows: its rows on one thread)
        if k == 1:
            return self._part(0, list(range(len(accepts))), accepts, fills, bitmask)
        part_of = {id(f[1]): i % k for i, f in enumerate(fills)}
        positions: list[list[int]] = [[] for _ in range(k)]
        for pos, (m, _) in enumerate(accepts):
            positions[part_of.get(id(m), 0)].append(pos)
        for i in range(k):
            self._work[i] = (
                positions[i],
                [accepts[pos] for pos in positions[i]],
                fills[i::k],
                bitmask,
            )
        for i in range(1, k):
            self._go[i].release()
        refused: list[int] = []
        error: BaseException | None = None
        try:
            refused += self._part(0, *self._work[0])
        except Exception as e:  # noqa: BLE001 (raised once every part has ended)
            error = e
        for _ in range(1, k):
            self._done.acquire()
        for i in range(1, k):
            result, self._results[i], self._work[i] = self._results[i], None, None
            if isinstance(result, BaseException):
                error = error or result
            else:
                refused += result
        if error is not None:
            raise error
        return sorted(refused)

    def _part(
        self,
        i: int,
        positions: list[int],
        accepts: list[tuple[Any, int]],
        fills: list[Fill],
        bitmask: Any,
    ) -> list[int]:
        refused = accept_tokens(
            [m for m, _ in accepts], [t for _, t in accepts], self._batch_accept
        )
        stops = self._stops
        ended = {id(m) for m, t in accepts if t in stops and m.is_terminated()}
        if ended:
            for f in fills:
                if id(f[1]) in ended:
                    allow_all(bitmask, f)
            fills = [f for f in fills if id(f[1]) not in ended]
        if fills:
            self.batchers[i].batch_fill_next_token_bitmask(
                [f[1] for f in fills], bitmask, [f[0] for f in fills]
            )
        for _, m, drafts, first in fills:
            if drafts:
                fill_draft_rows(m, drafts, bitmask, first)
        return [positions[j] for j in refused]

    def _serve(self, i: int) -> None:
        while True:
            self._go[i].acquire()
            try:
                self._results[i] = self._part(i, *self._work[i])
            except BaseException as e:  # noqa: BLE001 (the step's error, for run())
                self._results[i] = e
            self._done.release()


def main(argv: list[str]) -> None:
    info_fd, fd, rows, words, threads = map(int, argv[:5])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's Ctrl-C is the host's)
    _tighten_timer_slack()
    replies = os.dup(1)
    os.dup2(2, 1)  # (stray prints go to stderr, never into the answers)
    import xgrammar as xgr

    with os.fdopen(info_fd, "rb") as f:
        f.seek(0)  # (the core's file: it wrote it, this descriptor shares its offset)
        info = xgr.TokenizerInfo.deserialize_json(f.read().decode())
    tokens_at, flags_at, size = shared_layout(rows, words)
    shared = mmap.mmap(fd, size)
    buffers = np.frombuffer(shared, dtype=np.int32, count=2 * rows * words).reshape(2, rows, words)
    device_tokens = np.frombuffer(shared, dtype=np.int64, count=rows, offset=tokens_at)
    flags = np.frombuffer(shared, dtype=np.uint32, count=FLAG_WORDS, offset=flags_at)
    step = StepThreads(threads, xgr, frozenset(info.stop_token_ids))
    grammars: dict[int, Any] = {}
    matchers: dict[int, Any] = {}
    # A step that waits for its `ahead` tokens: (accepts, fills, bitmask, ahead
    # matchers), or the error its message gave (answered once the tokens come).
    waiting: tuple[Any, ...] | Exception | None = None
    stdin = sys.stdin.fileno()
    _send(replies, ["ok", []])  # (started)
    while True:
        try:
            msg = _recv(stdin)
        except EOFError:
            return
        kind = msg[0]
        if kind == "grammar":  # [_, grammar id, serialized]
            grammars[msg[1]] = xgr.CompiledGrammar.deserialize_json(msg[2], info)
        elif kind == "matchers":
            # [_, [[matcher id, grammar id], ...], [freed ids], [dropped grammar ids]]:
            # made, then let go (a matcher keeps its grammar)
            for mid, gid in msg[1]:
                matchers[mid] = xgr.GrammarMatcher(grammars[gid])
            for mid in msg[2]:
                matchers.pop(mid, None)
            for gid in msg[3]:
                grammars.pop(gid, None)
        elif kind == "step":
            # [_, [[matcher id, token], ...], buffer, [[row, matcher id], ...], [matcher
            # id, ...], seq]: the fifth, the accepts whose tokens come later: with seq 0,
            # in a "tokens" message; else (a device step) the device writes them to the
            # shared tokens, one per matcher (-1: none), then sets TOKENS_FLAG to seq,
            # and once the bitmask is filled this process sets MASK_FLAG to seq
            seq = msg[5] if len(msg) > 5 else 0
            try:
                plan: tuple[Any, ...] | Exception = (
                    [(matchers[m], t) for m, t in msg[1]],
                    [(f[0], matchers[f[1]], *(f[2:] or ([], 0))) for f in msg[3]],
                    buffers[msg[2]],
                    [matchers[m] for m in msg[4]],
                )
            except Exception as e:  # noqa: BLE001 (the step's error, told to the core)
                plan = e
            if seq:
                if not isinstance(plan, tuple):  # (its rows allow every token)
                    buffers[msg[2]] = -1
                _run_device_step(replies, step, plan, seq, device_tokens, flags)
            elif msg[4]:
                waiting = plan
            else:
                _run_step(replies, step, plan, [])
        elif kind == "tokens":  # [_, [[token, ...], ...]]: the waiting step's ahead tokens
            if waiting is None:
                raise ValueError("tokens came for no step")
            _run_step(replies, step, waiting, msg[1])
            waiting = None
        else:  # (ends the process: the core then finds it gone)
            raise ValueError(f"unknown message {kind!r}")


def _run_step(
    replies: int, step: StepThreads, plan: tuple[Any, ...] | Exception, tokens: list[list[int]]
) -> None:
    """Runs a step (`plan` from its message, `tokens` for its ahead matchers) and answers
    it: the positions of the refused tokens, or the error."""
    try:
        if isinstance(plan, Exception):
            raise plan
        accepts, fills, bitmask, ahead = plan
        if len(tokens) != len(ahead):
            raise ValueError(f"{len(tokens)} token lists for {len(ahead)} matchers")
        accepts = accepts + [(m, t) for m, toks in zip(ahead, tokens) for t in toks]
        _send(replies, ["ok", step.run(accepts, fills, bitmask)])
    except Exception as e:  # noqa: BLE001 (the step's error, told to the core)
        _send(replies, ["error", f"{type(e).__name__}: {e}"])


def _run_device_step(
    replies: int,
    step: StepThreads,
    plan: tuple[Any, ...] | Exception,
    seq: int,
    device_tokens: np.ndarray,
    flags: np.ndarray,
) -> None:
    """Waits for the device's tokens of a device step (`seq`), runs the step, sets the
    mask flag (the device goes on), and answers the step, the refused positions counting
    one accept per ahead matcher (those the device gave no token, -1, take none). A
    failed step's rows allow every token."""
    refused: list[int] | None = None
    error = ""
    try:
        if isinstance(plan, Exception):
            raise plan
        accepts, fills, bitmask, ahead = plan
        try:
            if ahead:
                _wait_flag(flags, TOKENS_FLAG, seq)
            tokens = device_tokens[: len(ahead)].tolist()
            given = [i for i, t in enumerate(tokens) if t >= 0]
            positions = list(range(len(accepts))) + [len(accepts) + i for i in given]
            pairs = accepts + [(ahead[i], tokens[i]) for i in given]
            refused = [positions[i] for i in step.run(pairs, fills, bitmask)]
        except Exception:
            for f in fills:
                allow_all(bitmask, f)
            raise
    except Exception as e:  # noqa: BLE001 (the step's error, told to the core)
        error = f"{type(e).__name__}: {e}"
    flags[MASK_FLAG] = seq
    _send(replies, ["ok", refused] if refused is not None else ["error", error])


# A device step's wait for its tokens looks at the flag between naps of this long (~25
# µs each with the process's timer slack at 1 µs, `_tighten_timer_slack`; ~75 with
# Linux's default of 50 µs). It does not spin: a step's message comes about a step
# before its tokens, so a spin would hold a core the whole time, and the engine's step
# thread, whose Python bounds the step, ran up to 1.5x slower beside it on a busy host.
# The nap's delay is hidden behind the step's forward, which runs meanwhile.
_NAP_S = 0.00002


def _tighten_timer_slack() -> None:
    """Linux: this process's sleeps end within 1 µs of their time (prctl
    PR_SET_TIMERSLACK); elsewhere nothing."""
    try:
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)
    except (OSError, AttributeError, TypeError):
        pass


def _wait_flag(flags: np.ndarray, index: int, seq: int) -> None:
    """Waits until `flags[index]` reaches `seq`; TimeoutError after STEP_TIMEOUT_S, or
    at once if the core's process is gone (this process then belongs to another)."""
    if flag_reached(int(flags[index]), seq):
        return
    parent = os.getppid()
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not flag_reached(int(flags[index]), seq):
        time.sleep(_NAP_S)
        if time.monotonic() > deadline or os.getppid() != parent:
            raise TimeoutError(f"the device did not give step {seq}'s tokens")


# -- the core's side -----------------------------------------------------------------


class GrammarProcessError(RuntimeError):
    """The grammar process ended or failed a step: its matchers are lost."""


class GrammarProcess:
    """The child and the pipes to it. `step` sends a step's accepts and fills; `answer`
    waits for the oldest step's answer (raising RuntimeError if the process has ended).
    Every other message has no answer."""

    def __init__(self, info_fd: int, fd: int, rows: int, words: int, threads: int) -> None:
        cmd = [sys.executable, "-m", "asyncllm.structured.grammar_process"]
        cmd += [str(info_fd), str(fd), str(rows), str(words), str(threads)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(info_fd, fd),
            env=envs.child_process_env(),
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()

    def send(self, msg: list[Any]) -> None:
        try:
            _send(self._in, msg)
        except (BrokenPipeError, OSError) as e:
            raise GrammarProcessError(f"the grammar process has ended ({self._exit()})") from e

    def answer(self, timeout: float | None = None) -> list[int]:
        """The positions of the accepts the grammars refused, for the oldest step sent.
        GrammarProcessError if the process ends, or does not answer within `timeout` s
        (STEP_TIMEOUT_S by default)."""
        timeout = STEP_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not select.select([self._out], [], [], _LIVENESS_S)[0]:
            if self.proc.poll() is not None:
                raise GrammarProcessError(f"the grammar process has ended ({self._exit()})")
            if time.monotonic() > deadline:
                raise GrammarProcessError(f"the grammar process has not answered in {timeout:g} s")
        try:
            status, value = _recv(self._out)
        except EOFError as e:
            raise GrammarProcessError(f"the grammar process has ended ({self._exit()})") from e
        if status != "ok":
            raise GrammarProcessError(f"the grammar process failed a step: {value}")
        return list(value)

    def _exit(self) -> str:
        try:
            code = self.proc.wait(timeout=_LIVENESS_S)
        except subprocess.TimeoutExpired:
            return "it no longer answers"
        return f"exit code {code}"

    def close(self, kill: bool = False) -> None:
        """Ends the process: EOF on its stdin (it returns), or at once with `kill`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if kill:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:  # (a pipe it had already left)
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    main(sys.argv[1:])
