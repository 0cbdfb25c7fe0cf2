"""Processes, read from /proc (Linux), for tests that check nothing is left behind."""

from __future__ import annotations

from pathlib import Path


def running(pid: int, module: str) -> bool:
    """Whether process `pid` runs `python -m <module>`."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return module.encode() in args


def children(pid: int, module: str | None = None) -> list[int]:
    """The pids whose parent is `pid` (those running `python -m <module>` only, if
    given)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        if int(fields[1]) == pid and (module is None or running(child, module)):
            out.append(child)
    return out


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie has: it waits only to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def socket_dir(core_pid: int) -> Path:
    """The private socket folder of an engine core (from its `--input ipc://DIR/in`)."""
    args = Path(f"/proc/{core_pid}/cmdline").read_bytes().decode().split("\0")
    return Path(args[args.index("--input") + 1].removeprefix("ipc://")).parent
