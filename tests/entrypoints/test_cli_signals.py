"""Signals as a terminal sends them: Ctrl-C and hang-up reach the whole foreground
process group (the engine's children too), and only the host acts on them; stale socket
folders of dead hosts are swept at start-up."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncllm.engine import host_launcher
from asyncllm.engine.host_launcher import remove_stale_ipc_dirs, start_child
from tests.entrypoints.procs import children, gone, socket_dir

pexpect = pytest.importorskip("pexpect")  # (the test extra; the GPU machine lacks it)
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")

# Model-free answers, long enough to be interrupted while they stream.
LONG = [
    "--device", "cpu", "--max-model-len", "8192", "--max-tokens", "8000",
    "--distributed-executor-backend", "asyncllm.executor.instant:InstantExecutor",
]  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still running once all have ended or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if not gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _engine_of(host: int) -> tuple[list[int], Path]:
    """The host's child processes (the core, the tokenizer process) and the core's
    socket folder."""
    (core,) = children(host, "asyncllm.engine.core_main")
    return children(host), socket_dir(core)


def test_chat_ctrl_c_stops_the_answer_and_hangup_leaves_nothing():
    """In a terminal: Ctrl-C during an answer stops it, and the next message is answered
    (the engine core ignored the Ctrl-C); the terminal's hang-up then ends the chat with
    no process and no socket folder left."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "asyncllm.cli.main", "chat", "--quiet", *LONG],
        encoding="utf-8",
        timeout=60,
    )
    try:
        child.expect_exact("you> ")
        engine, folder = _engine_of(child.pid)
        assert len(engine) == 2 and folder.is_dir()
        for message in ("Talk", "Again"):
            child.sendline(message)
            child.expect_exact("assistant> ")
            child.expect(r"\S")  # it is answering
            child.sendintr()  # ^C to the terminal: SIGINT to its foreground process group
            child.expect(r"(?s)(.*)\(interrupted\)")
            assert "EngineDeadError" not in child.match.group(1)
            child.expect_exact("you> ")
        assert child.isalive() and not any(gone(pid) for pid in engine)
        child.sendline("More")
        child.expect_exact("assistant> ")
        child.expect(r"\S")
        os.killpg(child.pid, signal.SIGHUP)  # the terminal closes mid-answer
        child.expect(pexpect.EOF)
        child.wait()
    finally:
        child.close(force=True)
    assert child.exitstatus == 128 + signal.SIGHUP
    assert _wait_gone(engine) == []
    assert not folder.exists()


def test_generate_ctrl_c_exits_130_quietly():
    """Ctrl-C to the process group of `asyncllm generate` mid-answer: exit status 130,
    nothing on stderr (no traceback from any process), no process or folder left."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncllm.cli.main", "generate", "Talk", "--quiet", *LONG],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # (its own process group, as a terminal's job has)
        # A terminal's job takes SIGINT; a suite run in the background (`make test &`)
        # ignores it, and its children would inherit that.
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 60)[0], "no answer within 60 s"
        assert proc.stdout.read(1)  # it is answering
        engine, folder = _engine_of(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert err.decode() == ""
    assert _wait_gone(engine) == []
    assert not folder.exists()


def test_a_child_starts_with_the_terminal_signals_blocked():
    """The child's mask blocks SIGINT and SIGHUP from its start (so during its imports);
    the calling thread's own mask is as it was."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    proc = start_child(
        [sys.executable, "-c", "print(open('/proc/self/status').read())"],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=30)
    blocked = int(next(x for x in out.splitlines() if x.startswith("SigBlk:")).split()[1], 16)
    assert {n for n in range(1, 65) if blocked >> (n - 1) & 1} >= {signal.SIGINT, signal.SIGHUP}
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _socket_folder(base: Path, name: str) -> Path:
    """A folder as a host makes it: its two sockets in it."""
    folder = base / name
    folder.mkdir(mode=0o700)
    for sock_name in ("in", "out"):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(folder / sock_name))
    return folder


def test_stale_socket_folders_of_dead_hosts_are_removed(tmp_path, monkeypatch):
    dead, alive = _dead_pid(), os.getpid()
    stale = _socket_folder(tmp_path, f"allm-{dead}-abc123")
    live = _socket_folder(tmp_path, f"allm-{alive}-def456")
    crowded = _socket_folder(tmp_path, f"allm-{dead}-ghi789")
    (crowded / "notes.txt").write_text("not ours")
    other = _socket_folder(tmp_path, f"other-{dead}-jkl012")
    monkeypatch.setattr(host_launcher.os, "getuid", lambda: os.geteuid() + 1)
    remove_stale_ipc_dirs(str(tmp_path))  # (as another user: nothing of theirs goes)
    assert stale.exists()
    monkeypatch.undo()
    remove_stale_ipc_dirs(str(tmp_path))
    assert not stale.exists()
    assert live.exists() and crowded.exists() and other.exists()
