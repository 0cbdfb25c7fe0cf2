"""The core's side of its workers: a handle per worker (what it said, and its life: a
child process here, a Ray actor in ray_distributed.py), and how a worker's end and
errors are told."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import signal
import socket
import subprocess
from collections import deque
from typing import Any

from asyncllm.executor.multiproc_messages import WorkerError


class WorkerDiedError(RuntimeError):
    """A worker process ended, or failed, while the engine needed it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` ("": every interface) now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rebuild_error(error_type: str, message: str) -> BaseException:
    """A worker's error as the builtin exception it was (ValueError, MemoryError, ...),
    else a WorkerDiedError naming its type."""
    cls = getattr(builtins, error_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 (a constructor that wants more)
            pass
    return WorkerDiedError(f"{error_type}: {message}")


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    """The core's side of one worker: what it said (`inbox`, and the error it sent
    before exiting), and its life (a process here; a Ray actor in ray_distributed.py)."""

    rank: int
    inbox: deque[Any] = dataclasses.field(default_factory=deque, kw_only=True)
    eof: bool = dataclasses.field(default=False, kw_only=True)  # its replies have ended
    error: WorkerError | None = dataclasses.field(default=None, kw_only=True)

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def poll(self) -> int | None:
        """Its exit code (negative: the signal that killed it), None while it runs."""
        raise NotImplementedError

    def wait(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for it to end."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return f"pid {self.pid}"


@dataclasses.dataclass(eq=False)
class WorkerProc(WorkerHandle):
    """A worker in a child process of this one, its replies on a pipe."""

    proc: subprocess.Popen
    replies: int  # the read end of its reply pipe (non-blocking)
    pending: bytearray = dataclasses.field(default_factory=bytearray)
    pidfd: int | None = None

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                self.proc.kill()
