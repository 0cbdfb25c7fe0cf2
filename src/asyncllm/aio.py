"""The few event-loop primitives AsyncLLM's host side needs, under asyncio and under trio.

asyncio is the native path: `AsyncioLoop` hands out asyncio's own futures and events and
its `call_soon`, with nothing wrapped, so a request costs the loop what it always did
(a generic layer over both, tried first, took a 10,000-request burst's loop-lag p99 from
6 ms to 60-80 ms). `TrioLoop` serves the same small interface with trio's primitives:
`Slot` is a one-shot future (awaitable, with asyncio's `done`/`cancelled`/`result`/
`add_done_callback`), `Flag` a resettable event. `running_loop()` picks one for the
library running the current task.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from concurrent.futures import Future as ThreadFuture
from typing import Any, Protocol


class FutureLike(Protocol):
    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def set_result(self, value: Any) -> None: ...
    def set_exception(self, error: BaseException) -> None: ...
    def result(self) -> Any: ...
    def exception(self) -> BaseException | None: ...
    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...
    def __await__(self) -> Generator[Any, None, Any]: ...


class EventLike(Protocol):
    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...
    async def wait(self) -> Any: ...


class AsyncioLoop:
    name = "asyncio"

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()

    def is_current(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def event(self) -> EventLike:
        return asyncio.Event()

    def future(self) -> FutureLike:
        return self.loop.create_future()

    def call_soon(self, fn: Callable[[], object]) -> None:
        self.loop.call_soon(fn)

    def submit(self, pool: Executor, fn: Callable[..., Any], *args: Any) -> FutureLike:
        """`fn(*args)` in `pool`; the future resolves (and its callbacks run) on the loop."""
        return self.loop.run_in_executor(pool, fn, *args)

    async def to_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def shielded(self) -> contextlib.AbstractContextManager[Any]:
        """Where clean-up must run to its end (asyncio has no cancel scopes to shield)."""
        return contextlib.nullcontext()


class Slot:
    """A one-shot future for trio. Awaiting it waits for its value; a waiter cancelled
    first marks it cancelled (as asyncio cancels a future whose awaiting task is)."""

    __slots__ = ("_callbacks", "_cancelled", "_error", "_event", "_value")

    def __init__(self) -> None:
        import trio

        self._event = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._callbacks: list[Callable[[Any], object]] = []

    def done(self) -> bool:
        return self._event.is_set()

    def cancelled(self) -> bool:
        return self._cancelled

    def set_result(self, value: Any) -> None:
        self._check_pending()
        self._value = value
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        self._check_pending()
        self._error = error
        self._finish()

    def result(self) -> Any:
        if (error := self.exception()) is not None:
            raise error
        return self._value

    def exception(self) -> BaseException | None:
        if self._cancelled:
            raise asyncio.CancelledError()
        if not self.done():
            raise asyncio.InvalidStateError("the result is not set yet")
        return self._error

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        if self.done():
            fn(self)
        else:
            self._callbacks.append(fn)

    def _check_pending(self) -> None:
        if self.done():
            raise asyncio.InvalidStateError("this slot is already done")

    def _finish(self) -> None:
        self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    async def _wait(self) -> Any:
        import trio

        try:
            await self._event.wait()
        except trio.Cancelled:
            if not self.done():
                self._cancelled = True
                self._finish()
            raise
        return self.result()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()


class Flag:
    """A resettable event for trio (trio's own events are set once)."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        import trio

        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            import trio

            self._event = trio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


class TrioLoop:
    name = "trio"

    def __init__(self) -> None:
        import trio

        self._trio = trio
        self.token = trio.lowlevel.current_trio_token()

    def is_current(self) -> bool:
        try:
            return self._trio.lowlevel.current_trio_token() is self.token
        except RuntimeError:
            return False

    def event(self) -> EventLike:
        return Flag()

    def future(self) -> FutureLike:
        return Slot()

    def call_soon(self, fn: Callable[[], object]) -> None:
        self.token.run_sync_soon(fn)

    def submit(self, pool: Executor, fn: Callable[..., Any], *args: Any) -> FutureLike:
        slot = Slot()

        def copy(done: ThreadFuture[Any]) -> None:
            if slot.done():
                return
            error = done.exception()
            if error is not None:
                slot.set_exception(error)
            else:
                slot.set_result(done.result())

        pool.submit(fn, *args).add_done_callback(lambda d: self.token.run_sync_soon(copy, d))
        return slot

    async def to_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._trio.to_thread.run_sync(fn, *args)

    def shielded(self) -> contextlib.AbstractContextManager[Any]:
        """Clean-up that runs to its end even inside a cancelled scope."""
        scope: contextlib.AbstractContextManager[Any] = self._trio.CancelScope(shield=True)
        return scope


def running_loop() -> AsyncioLoop | TrioLoop:
    """The primitives for the async library running the current task."""
    try:
        asyncio.get_running_loop()
        return AsyncioLoop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return TrioLoop()
        except RuntimeError:
            pass
    raise RuntimeError("AsyncLLM needs a running asyncio or trio event loop")
