"""The garbage collector and what start-up leaves: freeze it once an engine runs.

Importing torch and transformers and loading a tokenizer and a model leave a few hundred
thousand objects tracked by the garbage collector; every full collection walks them all
(0.4-1.1 s each on the 2-core machine, on the host's event loop), though none of them is
garbage. asyncllm itself makes no cyclic garbage per request.
"""

from __future__ import annotations

import gc

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
