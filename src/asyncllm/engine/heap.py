"""The garbage collector and what start-up leaves: freeze it once an engine runs.

Importing torch and transformers and loading a tokenizer and a model leave a few hundred
thousand objects tracked by the garbage collector; every full collection walks them all
(0.4-1.1 s each on the 2-core machine, on the host's event loop), though none of them is
garbage. asyncllm itself makes no cyclic garbage per request.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable

from asyncllm import envs


def freeze_startup_objects(collect: bool = True) -> None:
    """Once an engine has started: collects what start-up left for the garbage collector
    (unless `collect` is False: a full collection takes the GIL for as long as it walks,
    which an event loop must not wait for), then freezes every object still tracked (the
    imported libraries', the tokenizer's, the model's, the host application's), so later
    full collections skip them. Objects made later are collected as usual; frozen ones
    that die are freed by reference counting, and those in cycles once the engine shuts
    down (`unfreeze_objects`). `ASYNCLLM_GC_FREEZE=0` turns it off."""
    if envs.gc_freeze_enabled():
        if collect:
            gc.collect()
        gc.freeze()


def unfreeze_objects() -> None:
    """When an engine shuts down: what was frozen is collected as usual again (objects of
    the engine that die in reference cycles would otherwise never be freed); an engine
    still running in the process freezes only at its own start, so its objects are
    walked again until the next start."""
    if envs.gc_freeze_enabled():
        gc.unfreeze()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> bool:
    """Gives the C heap's free memory back to the system (glibc's `malloc_trim`); False
    where there is none to call. The engine core's CPU steps allocate and free
    temporaries of every size; glibc keeps what they free, so the process's resident
    memory grew by ~20% over 2,000 requests of the embedded model without this."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
