"""The serving tests' loop ticker (their shared AsyncLLM, `allm`, is in tests/conftest.py)."""

from __future__ import annotations

import asyncio

from tests.conftest import SERVING_ARGS

__all__ = ["SERVING_ARGS", "LoopTicker"]


class LoopTicker:
    """A 10 ms ticker on the running loop; `worst_gap` is the longest time between ticks
    (a blocking call on the loop shows up as a long gap)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not self._stop.is_set():
            await asyncio.sleep(0.01)
            now = loop.time()
            self.gaps.append(now - last)
            last = now

    async def __aenter__(self) -> LoopTicker:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await self._task

    @property
    def worst_gap(self) -> float:
        return max(self.gaps)
