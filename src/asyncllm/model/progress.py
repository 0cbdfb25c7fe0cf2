"""Progress bars for long model work (conversion, weight loading) on stderr: drawn only
when stderr is a terminal, and never with ASYNCLLM_PROGRESS=0 (`--quiet`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from asyncllm import envs

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    from tqdm.auto import tqdm

    disable = None if envs.progress_enabled() else True  # None: only on a terminal
    bar = tqdm(
        items, desc=desc, total=total, unit="tensor", leave=False, file=sys.stderr, disable=disable
    )
    yield from bar
