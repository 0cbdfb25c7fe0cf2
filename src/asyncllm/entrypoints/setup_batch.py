"""Request setup for AsyncLLM, off the event loop and batched (asyncio or trio).

Text prompts that arrive together (in one pass of the loop, or while a batch is being
tokenized) are tokenized in one tokenizer call in a worker thread; the loop's work per
request is an append and a wait. The first request to find no batch running leads the
next one: it yields once (the others of this pass join), hands the whole batch to the
thread, and sets every result; that work is shielded, so a leader that is cancelled
meanwhile still finishes the batch the others wait on. Chat templates run in the same
one-at-a-time thread limiter, one call each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from asyncllm.aio import Flag, Slot


class SetupThread:
    def __init__(self, tokenize_many: Callable[[list[Any]], list[Any]]) -> None:
        self._tokenize_many = tokenize_many
        self._limiter = anyio.CapacityLimiter(1)
        self._pending: list[tuple[Any, Slot[Any]]] = []
        self._busy = False  # a leader is gathering or tokenizing a batch
        self._batch_done = Flag()  # set (and replaced) each time a batch ends
        self._closed = False

    async def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        """`tokenize_prompt(prompt)`, batched with the prompts that arrive with it."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        slot: Slot[Any] = Slot()
        self._pending.append((prompt, slot))
        while not slot.done():
            if self._busy:
                done = self._batch_done
                await done.wait()
            else:
                await self._lead()
        result = await slot.get()
        if isinstance(result, Exception):
            raise result
        return result

    async def _lead(self) -> None:
        self._busy = True
        try:
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()  # the others of this pass join the batch
                batch, self._pending = self._pending, []
                prompts = [p for p, _ in batch]
                try:
                    results = await anyio.to_thread.run_sync(
                        self._tokenize_many, prompts, limiter=self._limiter
                    )
                except Exception as e:  # noqa: BLE001 (each waiter gets it)
                    results = [e] * len(batch)
                for (_, slot), result in zip(batch, results):
                    slot.set_result(result)
        finally:
            self._busy = False
            done, self._batch_done = self._batch_done, Flag()
            done.set()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the setup thread."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._limiter)

    def shutdown(self) -> None:
        self._closed = True
        for _, slot in self._pending:
            slot.set_exception(RuntimeError("the engine was shut down"))
        self._pending = []
