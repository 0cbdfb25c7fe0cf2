"""What a benchmark measures of the host: its event loop's lag and a process's memory."""

from __future__ import annotations

import asyncio


class LoopLag:
    """The overshoot of a 1 ms ticker on the running loop, while started: how long the
    loop could not run a ready task. `async with LoopLag() as lag: ...`, then
    `lag.p99_ms()`, `lag.max_ms()`."""

    def __init__(self) -> None:
        self.lags: list[float] = []  # seconds
        self._stop = asyncio.Event()
        self._ticking = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        await self._ticking.wait()  # the ticker runs before the work starts
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._ticking.set()
        while not self._stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            self.lags.append(loop.time() - t - 0.001)

    def percentile_ms(self, q: float) -> float:
        if not self.lags:
            return float("nan")
        s = sorted(self.lags)
        return s[int(q / 100 * (len(s) - 1))] * 1e3

    def p50_ms(self) -> float:
        return self.percentile_ms(50)

    def p99_ms(self) -> float:
        return self.percentile_ms(99)

    def max_ms(self) -> float:
        return max(self.lags, default=float("nan")) * 1e3


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process (this one by default), in MiB, from /proc (Linux)."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
