"""Request setup for AsyncLLM, off the event loop and batched.

Text prompts that arrive together (in one pass of the loop, or while the setup thread is
busy with earlier ones) are tokenized in one tokenizer call in the setup thread; the
loop's work per request is a future and an append, and one callback per batch sets the
results. Other setup work (chat templates) runs in the same thread, one call each. The
loop's primitives come from `asyncllm.aio` (asyncio's own, or trio's).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncllm.aio import AsyncioLoop, FutureLike, TrioLoop


class SetupThread:
    def __init__(
        self,
        aio: AsyncioLoop | TrioLoop,
        tokenize_many: Callable[[list[Any]], list[Any]],
    ) -> None:
        self._aio = aio
        self._tokenize_many = tokenize_many
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncllm-setup")
        self._pending: list[tuple[Any, FutureLike]] = []
        self._busy = False  # a batch is being tokenized, or its flush is scheduled

    async def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        """`tokenize_prompt(prompt)`, batched with the prompts that arrive with it."""
        fut = self._aio.future()
        self._pending.append((prompt, fut))
        if not self._busy:
            self._busy = True
            self._aio.call_soon(self._flush)  # after the others of this loop pass
        result = await fut
        if isinstance(result, Exception):
            raise result
        return result

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the setup thread."""
        return await self._aio.submit(self._pool, fn, *args)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        batch = [(p, f) for p, f in batch if not f.cancelled()]
        if not batch:
            self._busy = False
            return
        work = self._aio.submit(self._pool, self._tokenize_many, [p for p, _ in batch])
        work.add_done_callback(lambda done: self._deliver(batch, done))

    def _deliver(self, batch: list[tuple[Any, FutureLike]], done: FutureLike) -> None:
        if done.cancelled():
            error: BaseException | None = RuntimeError("request setup was cancelled")
        else:
            error = done.exception()
        results = [error] * len(batch) if error is not None else done.result()
        for (_, fut), result in zip(batch, results):
            if not fut.done():
                fut.set_result(result)
        self._busy = False
        if self._pending:
            self._busy = True
            self._flush()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
        for _, fut in self._pending:
            if not fut.done():
                fut.set_exception(RuntimeError("the engine was shut down"))
        self._pending = []
