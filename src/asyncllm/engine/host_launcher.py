"""The host's side of the process boundary: starting and owning an engine-core process
(which runs `engine.core_main`), starting child processes out of a terminal's reach, and
the private folder that holds the core's sockets."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncllm import envs
from asyncllm.child_process import start_child
from asyncllm.config import EngineArgs, is_torch_object
from asyncllm.messages import EngineStartup

MAX_IPC_PATH = 107  # bytes in a unix socket path (sun_path)


def startup_message(args: EngineArgs) -> EngineStartup:
    """The engine arguments as plain values (a torch dtype or device by its name)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        if is_torch_object(v, "dtype"):
            v = str(v).removeprefix("torch.")
        elif is_torch_object(v, "device"):
            v = str(v)
        out[f.name] = v
    return EngineStartup(engine_args=out)


IPC_PREFIX = "allm-"  # the private socket folder's name: allm-<the host's pid>-<random>
IPC_SOCKETS = ("in", "out")  # and it holds these two sockets, nothing else
_IPC_DIR_NAME = re.compile(re.escape(IPC_PREFIX) + r"(\d+)-\w+")


def _private_ipc_dir() -> str:
    """A 0700 folder with a short path (unix socket paths are limited to 107 bytes),
    named after this process; stale ones of dead hosts are removed first."""
    base = tempfile.gettempdir()
    if len(base) > 60:
        base = "/tmp"
    remove_stale_ipc_dirs(base)
    return tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # (not ours; not a pid: keep its folder)
        return True
    return True


def remove_stale_ipc_dirs(base: str) -> None:
    """Removes the socket folders in `base` whose host is dead (killed before anything
    could clean up): `allm-<pid>-…` with no process `pid`, that pass `_remove_ipc_dir`'s
    checks. A live host's folder, another user's, or one holding anything but our two
    sockets is kept."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        m = _IPC_DIR_NAME.fullmatch(name)
        if m and not _alive(int(m.group(1))):
            _remove_ipc_dir(Path(base, name))


def _remove_ipc_dir(folder: Path) -> bool:
    """Removes `folder` if it is a real folder of this user holding nothing but our
    sockets (named as IPC_SOCKETS). True if it is gone (already, or now)."""
    try:
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        entries = os.listdir(folder)
        if not set(entries) <= set(IPC_SOCKETS):
            return False
        for name in entries:
            if not stat.S_ISSOCK((folder / name).lstat().st_mode):
                return False
        for name in entries:
            (folder / name).unlink(missing_ok=True)
        folder.rmdir()
    except FileNotFoundError:  # removed meanwhile (by the host, or by its core)
        pass
    return not os.path.lexists(folder)


def remove_private_ipc_dir(input_addr: str, output_addr: str) -> bool:
    """Removes the private folder that holds the two sockets, from their addresses, if it
    looks like one of ours: both addresses `ipc://<dir>/in` and `ipc://<dir>/out`, the
    folder named `allm-…`, a real folder of this user holding nothing but those two
    sockets. The engine core calls this on its way out, since a killed host cleans
    nothing up. True if the folder is gone (already, or now)."""
    paths = []
    for addr, name in zip((input_addr, output_addr), IPC_SOCKETS, strict=True):
        if not addr.startswith("ipc://"):
            return False
        path = Path(addr.removeprefix("ipc://"))
        if path.name != name or not path.is_absolute():
            return False
        paths.append(path)
    folder = paths[0].parent
    if paths[1].parent != folder or not folder.name.startswith(IPC_PREFIX):
        return False
    return _remove_ipc_dir(folder)


# The core's oneDNN caches, unless the variables are set. Both keep an entry per input
# shape met (1,024 by default), and on the CPU, with prompts of every length, they grew
# the core's memory wave after wave: oneDNN's primitive cache, and ideep's cache of the
# packed linear layers' computations (LRU_CACHE_CAPACITY, the whole of the growth left
# once the first was capped). 16 entries cost no measured speed (docs/benchmarks.md).
CPU_CACHE_CAPACITIES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}


def core_env() -> dict[str, str]:
    """The engine core's environment: a child's (`envs.child_process_env`), with the
    CPU caches capped unless the variables are set."""
    env = envs.child_process_env()
    for name, value in CPU_CACHE_CAPACITIES.items():
        env.setdefault(name, value)
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
        self.proc = start_child(
            [
                sys.executable,
                "-m",
                "asyncllm.engine.core_main",
                "--input",
                self.input_addr,
                "--output",
                self.output_addr,
            ],
            stdin=subprocess.PIPE,
            env=core_env(),
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
