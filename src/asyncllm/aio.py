"""The few async primitives the host side needs, on anyio, so AsyncLLM runs under
asyncio and trio alike (a leaf: it imports only anyio and sniffio).

`Flag` is an event that can be cleared (anyio's events are one-shot), `Slot` a one-shot
result to await (a future without the event loop), and `loop_identity()` names the
event loop the caller runs in, so an AsyncLLM can refuse another loop's use.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import anyio
import sniffio

T = TypeVar("T")


class Flag:
    """Set by producers, awaited by one consumer that clears it before waiting again."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


class Slot(Generic[T]):
    """A result (or an error) set once and awaited by any number of tasks."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, value: T) -> None:
        if not self.done():
            self._value = value
            self._event.set()

    def set_exception(self, error: BaseException) -> None:
        if not self.done():
            self._error = error
            self._event.set()

    async def get(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def backend() -> str:
    """'asyncio' or 'trio' (raises outside an async context)."""
    return sniffio.current_async_library()


def loop_identity() -> Any:
    """An object that is the same for every task of one running event loop, or None
    outside any."""
    try:
        name = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if name == "trio":
        import trio

        return trio.lowlevel.current_trio_token()
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
