"""How many threads torch uses for the engine core's CPU work (intra-op parallelism:
matmuls, attention, sampling).

torch's default is one thread per core, and the core keeps it unless
`EngineArgs(cpu_threads=N)` says otherwise (or OMP_NUM_THREADS, which torch reads
itself). On a machine busy with other work those threads contend for the same cores,
and a CPU decode step can get several times slower than with fewer threads (7.6x
against one thread, measured on a 2-core machine under load): set `cpu_threads` there.
A default that guessed the load from the 1-minute load average was tried and dropped: it
also counts the machine's recent past, and an engine started a minute after a busy spell
ran with one thread on an idle 2-core machine, 60% slower.
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


def set_cpu_threads(config: EngineConfig) -> int:
    """Sets torch's intra-op thread count to `cpu_threads` when the user set it, and
    returns the count the core uses."""
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    n = torch.get_num_threads()
    logger.info("engine core: %d torch threads (of %d CPUs)", n, available_cpus())
    return n
