"""The engine core's side of structured outputs (after vLLM v1's StructuredOutputManager).

Grammars compile in a small thread pool, cached by key, so the step loop never waits for
one while it has other work; a request waits in the scheduler until its grammar is
ready, and a grammar that fails ends only that request. Each request gets its own
matcher: before a step samples it, the scheduler fills its row of the token bitmask
(bit t of a row set: token t may come next) and the model runner masks the logits with
it on the device; each token the request keeps advances its matcher.
"""

from __future__ import annotations

import functools
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from asyncllm.envs import grammar_threads
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured.grammar import GrammarKey, build_grammar, grammar_key, xgrammar_module


class StructuredRequest:
    """One request's constraint: its grammar (compiling, then compiled) and matcher."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: Future[Any]) -> None:
        self.future = future
        self.matcher: Any = None

    def ready(self) -> bool:
        """Whether the grammar is compiled (its matcher made) or failed."""
        if self.matcher is None and self.future.done() and self.future.exception() is None:
            import xgrammar

            self.matcher = xgrammar.GrammarMatcher(self.future.result())
        return self.future.done()

    def error(self) -> str | None:
        e = self.future.exception() if self.future.done() else None
        return None if e is None else f"{type(e).__name__}: {e}"

    def accept(self, token: int) -> bool:
        """Advances the matcher by a token the request keeps; False if the grammar does
        not allow it (or has already ended)."""
        return bool(self.matcher.accept_token(token))


# Tokens matchers are still to accept, (key, request, token), oldest first; the key (the
# scheduler's request) comes back with each token its grammar refused.
Accepts = list[tuple[Any, StructuredRequest, int]]
Rows = list[tuple[int, StructuredRequest]]


@functools.cache
def _batch_accept() -> Any:
    """xgrammar's batch accept, (matchers, tokens) -> their results (1 or True:
    accepted), straight from its core: the public wrapper turns the results into a list
    with one FFI call per row, each giving up and taking back the GIL (~70 µs at 64)."""
    try:
        from xgrammar.base import _core

        raw = _core.BatchGrammarMatcher.batch_accept_token
    except (ImportError, AttributeError):  # (another layout: the public wrapper)
        return xgrammar_module().BatchGrammarMatcher.batch_accept_token
    return lambda matchers, tokens: raw([m._handle for m in matchers], tokens, False)


class FillJob:
    """A bitmask fill on the manager's fill thread; `wait()` returns once it is done
    (raising what it raised)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class StructuredOutputManager:
    def __init__(self, tokenizer: str | None, vocab_size: int, pin_memory: bool = False) -> None:
        self.tokenizer_path = tokenizer
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory  # (CUDA: the runner copies the bitmask to the device as it is)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="asyncllm-grammar")
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: dict[GrammarKey, Future[Any]] = {}
        # Two persistent bitmasks, taken in turn (see allocate_bitmask), and the step
        # that used each last.
        self._bitmasks: list[torch.Tensor] = []
        self._users: list[Any] = [None, None]
        self._next_bitmask = 0
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made at the first fill
        # The fill thread (start_fill), made at its first job, with its own batch matcher
        self._fill_thread: threading.Thread | None = None
        self._fill_batch: Any = None
        self._fill_cv = threading.Condition()
        self._fill_queue: list[tuple[FillJob, Any, Rows] | None] = []
        self._job: FillJob | None = None  # the fill thread's last job
        self._stop_token_ids: frozenset[int] = frozenset()

    def _get_compiler(self) -> Any:
        with self._lock:  # (built once, by the first compilation)
            if self._compiler is None:
                if self.tokenizer_path is None:
                    raise ValueError("structured outputs need the tokenizer (skip_tokenizer_init)")
                from transformers import AutoTokenizer

                xgr = xgrammar_module()
                tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
                self._stop_token_ids = frozenset(info.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        return self._get_compiler().compile_grammar(build_grammar(key))

    def request(self, so: StructuredOutputsParams) -> StructuredRequest:
        """A constraint for a new request; its grammar compiles in the background (once
        per key: a failed one is tried again by the next request that asks)."""
        key = grammar_key(so)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._cache[key] = self._pool.submit(self._compile, key)
        return StructuredRequest(fut)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar: a matcher is terminated once it accepts one
        (set once a grammar has compiled)."""
        return self._stop_token_ids

    def accept(self, accepts: Accepts) -> list[Any]:
        """Advances the matchers by `accepts`, in order, in this thread (once a fill
        thread's job is done: its matchers may be these); returns the keys of the tokens
        their grammar refused. One xgrammar call (64 rows on the 2-core development
        machine: 57 µs against 90 row by row for the H200 benchmarks' array schema, 176
        against 182 for an object schema). Run here rather than on the fill thread: on
        the H200 that was slower end to end (each FFI call there waits for the GIL,
        which the step's thread holds)."""
        if not accepts:
            return []
        self._wait_job()
        matchers = [r.matcher for _, r, _ in accepts]
        if len({id(m) for m in matchers}) < len(matchers):  # (a matcher twice: in order)
            return [key for key, r, t in accepts if not r.accept(t)]
        ok = _batch_accept()(matchers, [t for *_, t in accepts])
        if 0 not in ok:
            return []
        return [a[0] for a, good in zip(accepts, list(ok)) if not good]

    def fill_bitmask(self, bitmask: torch.Tensor, rows: Rows) -> None:
        """Fills `bitmask`'s rows from their requests' matchers ((row, request) pairs),
        in this thread once a fill thread's job is done. One xgrammar call, on one
        thread unless ASYNCLLM_GRAMMAR_THREADS says otherwise: at 64 rows on a 16-core
        host 306 µs, against 436 row by row and 776 on xgrammar's default threads."""
        self._wait_job()
        if self._batch is None:
            self._batch = xgrammar_module().BatchGrammarMatcher(max_threads=grammar_threads())
        self._fill(self._batch, bitmask, rows)

    def _wait_job(self) -> None:
        if self._job is not None:
            self._job.done.wait()

    @staticmethod
    def _fill(batch: Any, bitmask: torch.Tensor, rows: Rows) -> None:
        if rows:
            matchers = [r.matcher for _, r in rows]
            batch.batch_fill_next_token_bitmask(matchers, bitmask, [i for i, _ in rows])

    def start_fill(self, bitmask: torch.Tensor, rows: Rows) -> FillJob:
        """`fill_bitmask` on the fill thread, while the caller goes on; returns once the
        job is under way. xgrammar's calls release the GIL, so the fill overlaps the
        step's other host work; the caller must leave those matchers alone until
        `wait()`."""
        job = FillJob()
        if not rows:
            job.done.set()
            return job
        if self._fill_thread is None:
            self._fill_batch = xgrammar_module().BatchGrammarMatcher(max_threads=grammar_threads())
            self._fill_thread = threading.Thread(
                target=self._fill_loop, name="asyncllm-grammar-fill", daemon=True
            )
            self._fill_thread.start()
            # Once its fill is done the thread needs the GIL back: within 20 µs, not
            # the default 5 ms a busy step thread would otherwise keep it (on the H200
            # host, constrained batch-64 decode 32k tok/s against 28k at 0.2 ms).
            sys.setswitchinterval(min(sys.getswitchinterval(), 2e-5))
        self._job = job
        with self._fill_cv:
            self._fill_queue.append((job, bitmask, rows))
            self._fill_cv.notify()
            # Until the thread has taken the job it needs the GIL, which this thread
            # would hold for its whole next stretch of Python: wait, without it.
            while self._fill_queue:
                self._fill_cv.wait()
        return job

    def _fill_loop(self) -> None:
        while True:
            with self._fill_cv:
                while not self._fill_queue:
                    self._fill_cv.wait()
                item = self._fill_queue.pop()
                self._fill_cv.notify()  # (taken)
            if item is None:
                return
            job, bitmask, rows = item
            try:
                self._fill(self._fill_batch, bitmask, rows)
            except BaseException as e:  # (raised by wait(), in the step's thread)
                job.error = e
            job.done.set()

    def allocate_bitmask(self, rows: int, user: Any = None) -> torch.Tensor:
        """A bitmask of `rows` rows for the step `user`, its contents undefined until the
        fill writes every row: a view of one of two persistent buffers (pinned if
        `pin_memory`), taken in turn. A buffer is
        written again only once the copy that read it for its last step has run: that
        step's `grammar_bitmask_copied` (a CUDA event the model runner records after its
        copy to the device; absent, the runner copied it synchronously or not at all)."""
        words = -(-self.vocab_size // 32)
        if not self._bitmasks or self._bitmasks[0].shape[0] < rows:
            self._bitmasks = [
                torch.empty(rows, words, dtype=torch.int32, pin_memory=self.pin_memory)
                for _ in range(2)
            ]
            self._users = [None, None]
        k = self._next_bitmask
        self._next_bitmask ^= 1
        copied = getattr(self._users[k], "grammar_bitmask_copied", None)
        if copied is not None and not copied.query():  # (at depth 2 it has long run)
            copied.synchronize()
        self._users[k] = user
        return self._bitmasks[k][:rows]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._fill_thread is not None:
            with self._fill_cv:
                self._fill_queue.append(None)
                self._fill_cv.notify()
            self._fill_thread.join()
            self._fill_thread = None
