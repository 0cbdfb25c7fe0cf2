"""How many threads torch uses for the engine core's CPU work (intra-op parallelism:
matmuls, attention, sampling).

torch's default is one thread per core. On a machine that is busy with other work (the
application, other processes), that many threads contend for the same cores and a
decode step on the CPU gets several times slower than with fewer threads (7.6x against
one thread, measured on a 2-core machine under load). The engine's default therefore
takes the CPUs this process may run on less the ones already busy, judged by the
1-minute load average when the core starts; `EngineArgs(cpu_threads=N)` fixes it.
"""

from __future__ import annotations

import logging
import os

import torch

from asyncllm.config import EngineConfig

logger = logging.getLogger(__name__)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        return os.cpu_count() or 1


def default_cpu_threads(cpus: int | None = None, load: float | None = None) -> int:
    """The CPUs this process may use, less the busy ones (the whole part of the 1-minute
    load average), at least 1."""
    cpus = available_cpus() if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    return max(1, min(cpus, cpus - int(load)))


def set_cpu_threads(config: EngineConfig, own_process: bool) -> int | None:
    """Sets torch's intra-op thread count for the engine core and returns it, or None
    where it is left as it was: `cpu_threads` when the user set it; otherwise, in the
    core's own process, OMP_NUM_THREADS when set (torch already read it), else
    `default_cpu_threads()`; in the caller's process (multiprocess=False) the
    application's setting stays."""
    n = config.cpu_threads
    if n is None and own_process and not os.environ.get("OMP_NUM_THREADS"):
        n = default_cpu_threads()
    if n is None:
        return None
    torch.set_num_threads(n)
    logger.info("engine core: %d torch threads (of %d CPUs)", n, available_cpus())
    return n
