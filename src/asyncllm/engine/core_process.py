"""Starting and owning an engine-core process, and the errors clients raise about it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from asyncllm.config import EngineArgs

MAX_IPC_PATH = 107  # bytes in a unix socket path (sun_path)


class EngineDeadError(RuntimeError):
    """The engine core is gone (killed, crashed, shut down); nothing more will come."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message carries its reason."""


class EngineOverloadedError(RuntimeError):
    """The engine refused a request: too many are already waiting."""


def engine_args_to_wire(args: EngineArgs) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        elif isinstance(v, torch.device):
            v = str(v)
        out[f.name] = v
    return out


def _private_ipc_dir() -> str:
    """A 0700 folder with a short path (unix socket paths are limited to 107 bytes)."""
    base = tempfile.gettempdir()
    if len(base) > 60:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="allm-", dir=base)


def _child_env() -> dict[str, str]:
    """Our environment, with the folders asyncllm was imported from on PYTHONPATH, so a
    source checkout works without installing."""
    import asyncllm

    roots = [str(Path(asyncllm.__file__).resolve().parents[1])]
    try:
        import asyncllm_kernels

        roots.append(str(Path(asyncllm_kernels.__file__).resolve().parents[1]))
    except ImportError:
        pass
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(roots + ([old] if old else []))
    return env


class CoreProcess:
    """The process and the addresses of its two sockets (the client binds them)."""

    def __init__(self) -> None:
        self.ipc_dir = _private_ipc_dir()
        self.input_addr = f"ipc://{self.ipc_dir}/in"
        self.output_addr = f"ipc://{self.ipc_dir}/out"
        if len(self.output_addr) - len("ipc://") > MAX_IPC_PATH:
            raise RuntimeError(f"socket path {self.output_addr!r} is too long")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # stdin is a pipe whose write end only we hold: when this process dies, the
        # child reads EOF and exits (unlike PR_SET_PDEATHSIG, which follows a thread).
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncllm.engine.core_proc",
                "--input",
                self.input_addr,
                "--output",
                self.output_addr,
            ],
            stdin=subprocess.PIPE,
            env=_child_env(),
            close_fds=True,
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout)
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
