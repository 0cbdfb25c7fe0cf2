"""How many threads torch uses for the engine core's CPU work (intra-op parallelism:
matmuls, attention, sampling).

`EngineArgs(cpu_threads=N)` (or OMP_NUM_THREADS, which torch reads itself) fixes the
count. Otherwise, on the CPU device, the core starts with torch's own count (one thread
per core) and follows what the machine leaves free: every second of stepping it reads
how much CPU time other processes took on its CPUs (`/proc/stat` less its own time) and
runs with the cores left, never more than torch's count nor fewer than one. On a
2-core machine a CPU decode step with two threads while another process kept one core
busy ran 7.6x slower than with one thread: each parallel region waits for its slowest
thread, and one of them shares a core. The count changes only when two windows in a
row agree, so a short burst of other work does not make it flap. (A default from the
1-minute load average was tried first and dropped: it counts the machine's recent past,
so an engine started a minute after a busy spell ran with one thread on an idle machine.)
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch

from asyncllm.config import EngineConfig
from asyncllm.envs import available_cpus

logger = logging.getLogger(__name__)

WINDOW_S = 1.0  # how long one reading of the machine's load spans
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat: user nice system (idle iowait) irq softirq steal


def busy_cpu_seconds(cpus: list[int], stat_path: str = "/proc/stat") -> float:
    """CPU time spent busy (by any process) on these CPUs since boot, in seconds."""
    wanted = {f"cpu{i}" for i in cpus}
    ticks = 0
    with open(stat_path) as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name in wanted:
                values = rest.split()
                ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU time (all its threads), in seconds."""
    t = os.times()
    return t.user + t.system


def threads_for(num_cpus: int, others_busy: float, most: int) -> int:
    """The thread count for `num_cpus` CPUs of which other processes keep `others_busy`
    cores' worth busy: the cores left (a half-free core counts), within 1..most."""
    return max(1, min(most, math.floor(num_cpus - others_busy + 0.5)))


class ThreadTuner:
    """Follows the CPU left free by other processes (see the module's docstring);
    `tick()` is called once per engine step and costs one clock read between windows."""

    def __init__(
        self,
        cpus: list[int],
        most: int,
        read_busy: Callable[[], float],
        read_own: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.num_cpus = len(cpus)
        self.most = most
        self.threads = most
        self._read_busy = read_busy
        self._read_own = read_own
        self._clock = clock
        self._set_threads = set_threads
        self._proposed: int | None = None  # a new count one window asked for
        self._start = (clock(), read_busy(), read_own())

    def tick(self) -> None:
        now = self._clock()
        t0, busy0, own0 = self._start
        if now - t0 < WINDOW_S:
            return
        busy, own = self._read_busy(), self._read_own()
        self._start = (now, busy, own)
        others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
        want = threads_for(self.num_cpus, others, self.most)
        if want == self.threads:
            self._proposed = None
        elif want == self._proposed:
            logger.info(
                "engine core: %d torch threads (other processes keep %.1f of %d CPUs busy)",
                want,
                others,
                self.num_cpus,
            )
            self._set_threads(want)
            self.threads = want
            self._proposed = None
        else:
            self._proposed = want


def set_cpu_threads(config: EngineConfig) -> ThreadTuner | None:
    """Sets torch's intra-op thread count to `cpu_threads` when the user set it; on the
    CPU device with no count given (by `cpu_threads` or OMP_NUM_THREADS), returns the
    tuner that follows the machine's free CPU."""
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    n = torch.get_num_threads()
    cpus = available_cpus()
    logger.info("engine core: %d torch threads (of %d CPUs)", n, len(cpus))
    if (
        config.cpu_threads is not None
        or "OMP_NUM_THREADS" in os.environ
        or config.model.device.type != "cpu"
        or n == 1
    ):
        return None
    try:
        busy_cpu_seconds(cpus)
    except (OSError, ValueError, IndexError):  # no /proc/stat (not Linux)
        return None
    return ThreadTuner(cpus, n, lambda: busy_cpu_seconds(cpus))
