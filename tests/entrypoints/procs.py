"""Processes, read from /proc (Linux), for tests that check nothing is left behind."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out
