"""The engine-core process: orderly start/shutdown, malformed input, I/O thread failures,
and the private socket folder. Model-free: the embedded model's config and tokenizer with
an executor that answers at once.

Most tests run `EngineCoreProc` on a thread of this process against real ZMQ sockets
bound as the clients bind them; the 50 start/shutdown cycles run real core processes
forked from a warm parent (`core_zygote.py`: a fresh interpreter spends seconds importing
torch and transformers); a few start the process exactly as the clients do.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import zmq

import asyncllm
from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.config import EngineArgs
from asyncllm.engine import core_main
from asyncllm.engine.core_main import EngineCoreProc
from asyncllm.engine.host_launcher import CoreProcess, startup_message
from asyncllm.engine.serial import Decoder, Encoder
from asyncllm.messages import (
    FROM_CORE,
    DeadKind,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    MsgKind,
    UtilityCall,
    UtilityResult,
)
from tests.conftest import ROOT
from tests.serving.test_failures import _pid_alive

on_session_loop = pytest.mark.asyncio(loop_scope="session")  # the async tests' loop

INSTANT = dict(
    device="cpu",
    max_model_len=1024,
    distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
)
CORE_ARGS = EngineArgs(**INSTANT, num_gpu_blocks_override=128)
GUARD_S = 30.0  # only a hang guard: every wait below ends on a condition
IO_THREADS = ("core-input", "core-output")
DEEP = b"\x91" * 100_000 + b"\xc0"  # a list in a list in ... 100 000 deep
DEEP_MAP = b"\x81\xa4junk" + DEEP  # a map whose one value is nested too deep
CALL_ID = 65_535  # a utility call whose arguments are nested too deep:
DEEP_CALL = b"\x93" + msgspec.msgpack.encode(CALL_ID) + msgspec.msgpack.encode("get") + DEEP


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in IO_THREADS]


def _request(rid: str, max_tokens: int = 3) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, [1, 2, 3], params, None, max_tokens, time.time())


def _with_deep_field(msg: Any) -> bytes:
    """The message's own map (request_id first), plus a field nested 100 000 deep."""
    body = msgspec.msgpack.encode(msg)
    assert 0x80 < body[0] < 0x8F  # a fixmap: add one entry
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode("junk") + DEEP


class HostSide:
    """The two sockets bound as a client binds them (in a private allm- folder), with the
    startup message sent; the core on the other end is the subclass's."""

    def __init__(self) -> None:
        self.where = CoreProcess()  # the private folder and the addresses; never started
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(self.where.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)  # as the clients bind it (host_client._MPClientBase)
        self.output.bind(self.where.output_addr)
        self.encoder, self.decoder = Encoder(), Decoder(FROM_CORE)

    def send_frames(self, frames: list) -> None:
        self.input.send_multipart(frames, copy=False)

    def send(self, msg: Any) -> None:
        self.send_frames(self.encoder.encode(msg))

    def recv(self) -> tuple[MsgKind, Any]:
        if not self.output.poll(int(GUARD_S * 1000)):
            raise TimeoutError("no message from the core")
        return self.decoder.decode(self.output.recv_multipart())

    def wait_for(self, kind: MsgKind) -> Any:
        while True:
            got, obj = self.recv()
            if got is kind:
                return obj

    def finish(self, rid: str) -> EngineCoreOutputs:
        """Outputs until request `rid` finishes; returns the last."""
        while True:
            out = self.wait_for(MsgKind.OUTPUTS)
            if any(o.request_id == rid and o.finished for o in out.outputs):
                return out

    def close_sockets(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.where.ipc_dir, ignore_errors=True)


class InProcessCore(HostSide):
    """An EngineCoreProc on a thread of this process. `run()` returns what the process
    would exit with."""

    def __init__(self, args: EngineArgs = CORE_ARGS) -> None:
        super().__init__()
        self.proc = EngineCoreProc(self.where.input_addr, self.where.output_addr)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name="test-core", daemon=True)
        self.thread.start()
        self.send(startup_message(args))

    def _run(self) -> None:
        self.code = self.proc.run()

    def end(self) -> int | None:
        """Waits for the core's thread to return, then closes our side."""
        self.thread.join(GUARD_S)
        assert not self.thread.is_alive(), "the core did not exit"
        self.close()
        return self.code

    def close(self) -> None:
        if self.thread.is_alive():
            self.proc.request_stop("test over")
            self.thread.join(GUARD_S)
        self.close_sockets()


@pytest.fixture
def core():
    cores: list[InProcessCore] = []

    def make(args: EngineArgs = CORE_ARGS) -> InProcessCore:
        cores.append(InProcessCore(args))
        return cores[-1]

    yield make
    for c in cores:
        c.close()


# --- 2. start/shutdown in order ---------------------------------------------------------


def test_io_threads_are_joined_before_any_socket_closes(core, monkeypatch):
    """Stopped while outputs stream: both I/O threads have ended before the first of the
    core's sockets closes, and the context ends after the last."""
    events: list[tuple[str, list[str]]] = []
    close, term = zmq.Socket.close, zmq.Context.term
    c = core()
    proc = c.proc
    names = {id(proc.input): "input", id(proc.output): "output"}
    names |= {id(proc._wake_rx): "wake", id(proc._wake_tx): "wake"}

    def recording_close(sock, *args, **kwargs):
        if id(sock) in names and not sock.closed:
            events.append((names[id(sock)], _io_threads()))
        return close(sock, *args, **kwargs)

    def recording_term(ctx, *args, **kwargs):
        if ctx is proc.ctx:
            events.append(("term", _io_threads()))
        return term(ctx, *args, **kwargs)

    monkeypatch.setattr(zmq.Socket, "close", recording_close)
    monkeypatch.setattr(zmq.Context, "term", recording_term)
    c.wait_for(MsgKind.READY)
    assert sorted(_io_threads()) == sorted(IO_THREADS)
    c.send(_request("busy", max_tokens=10_000))
    c.wait_for(MsgKind.OUTPUTS)
    proc.request_stop("test")
    assert c.wait_for(MsgKind.DEAD).kind is DeadKind.STOPPED
    c.thread.join(GUARD_S)
    monkeypatch.undo()
    assert c.end() == 0
    assert {"input", "output"} <= {name for name, _ in events}
    assert events[-1][0] == "term"
    for name, alive in events:
        assert alive == [], f"{name} closed while {alive} still ran"


class Zygote:
    """tests/serving/core_zygote.py in a subprocess: forks real core processes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.serving.core_zygote"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._read() == "ready"

    def _read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, line: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return int(self._read().split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(GUARD_S) == 0


def test_fifty_process_start_shutdown_cycles_exit_0():
    """50 real engine-core processes (forked from a warm parent, so the interpreter's
    imports are paid once), alternately idle and mid-stream when SIGTERM arrives, as
    `CoreProcess.stop` sends it: each reports STOPPED, exits with code 0 and removes its
    socket folder."""
    zygote = Zygote()
    t0 = time.monotonic()
    try:
        for i in range(50):
            host = HostSide()
            try:
                pid = zygote.ask(f"start {host.where.input_addr} {host.where.output_addr}")
                host.send(startup_message(CORE_ARGS))
                assert isinstance(host.wait_for(MsgKind.READY), EngineReady)
                host.send(_request(f"r{i}", max_tokens=5 if i % 2 else 10_000))
                if i % 2:
                    host.finish(f"r{i}")
                else:
                    host.wait_for(MsgKind.OUTPUTS)  # stopped while it streams
                os.kill(pid, signal.SIGTERM)
                assert host.wait_for(MsgKind.DEAD).kind is DeadKind.STOPPED
                assert zygote.ask(f"wait {pid}") == 0, f"cycle {i}"
                assert not os.path.exists(host.where.ipc_dir)
            finally:
                host.close_sockets()
    finally:
        zygote.close()
    print(f"50 process cycles: {time.monotonic() - t0:.1f} s")


def test_ten_in_process_cycles_leave_no_io_thread(core):
    """The same cycle with the core on a thread here: no I/O thread outlives a stop."""
    for i in range(10):
        c = core()
        assert isinstance(c.wait_for(MsgKind.READY), EngineReady)
        c.send(_request(f"r{i}", max_tokens=5 if i % 2 else 10_000))
        if i % 2:
            c.finish(f"r{i}")
        else:
            c.wait_for(MsgKind.OUTPUTS)
        c.proc.request_stop("test")
        assert c.wait_for(MsgKind.DEAD).kind is DeadKind.STOPPED
        assert c.end() == 0, f"cycle {i}"
        assert _io_threads() == []
        assert not os.path.exists(c.where.ipc_dir)


@on_session_loop
async def test_a_process_start_shutdown_cycle_exits_0():
    """The real process, through the blocking client (AsyncLLM's cycle is `instant_llm`
    below, which checks the same when it shuts down): exit code 0, no socket folder left."""
    llm = await asyncio.to_thread(LLM, multiprocess=True, **INSTANT)
    process = llm.engine.client.process
    out = await asyncio.to_thread(llm.generate, "Hi", SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
    await asyncio.to_thread(llm.shutdown)
    assert process.exit_code() == 0
    assert not os.path.exists(process.ipc_dir)


def test_an_interrupted_start_leaves_no_core_process_behind(monkeypatch):
    """Ctrl-C while `LLM()` waits for the core to be ready (as in a notebook, which
    keeps the traceback, and so the client): the core process is stopped and its socket
    folder removed before the interrupt goes on."""
    from asyncllm.engine.host_client import SyncMPClient

    clients = []
    wait_for = SyncMPClient._wait_for

    def interrupted(self, match, timeout):
        clients.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(SyncMPClient, "_wait_for", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(multiprocess=True, **INSTANT)
    monkeypatch.setattr(SyncMPClient, "_wait_for", wait_for)
    (client,) = clients
    assert client.process.exit_code() is not None
    assert not os.path.exists(client.process.ipc_dir)


# --- 6. I/O thread failures: survived, or fatal and loud ------------------------------


def test_an_output_thread_failure_kills_the_engine_loudly(core, monkeypatch):
    class FailsOnOutputs(Encoder):
        def encode(self, msg):
            if isinstance(msg, EngineCoreOutputs):
                raise RuntimeError("simulated encoder bug")
            return super().encode(msg)

    monkeypatch.setattr(core_main, "Encoder", FailsOnOutputs)
    c = core()
    c.wait_for(MsgKind.READY)
    c.send(_request("a"))
    dead = c.wait_for(MsgKind.DEAD)
    assert dead.kind is DeadKind.CRASHED and "simulated encoder bug" in dead.reason
    assert c.end() == 1
    assert _io_threads() == []


def test_an_input_thread_failure_kills_the_engine_loudly(core, monkeypatch):
    def broken(decoder, frames):
        raise RuntimeError("simulated input bug")

    monkeypatch.setattr(EngineCoreProc, "_decode", staticmethod(broken))
    c = core()
    c.wait_for(MsgKind.READY)
    c.send(_request("a"))
    dead = c.wait_for(MsgKind.DEAD)
    assert dead.kind is DeadKind.CRASHED and "simulated input bug" in dead.reason
    assert c.end() == 1


def test_malformed_frames_are_dropped_or_answered_and_the_core_serves_on(core):
    c = core()
    c.wait_for(MsgKind.READY)
    for frames in (
        [b"A", DEEP],
        [b"A", DEEP_MAP],  # no request id to answer
        [b"X", DEEP],
        [b"U", DEEP],
        [b"A", b"\xc1"],
        [b"Z", b"\x90"],
        [b"A"],
    ):
        c.send_frames(frames)
    c.send_frames([b"U", DEEP_CALL])
    result = c.wait_for(MsgKind.UTILITY_RESULT)
    assert result.call_id == CALL_ID and "malformed UTILITY" in result.error
    c.send(UtilityCall(8, "ping"))
    assert c.wait_for(MsgKind.UTILITY_RESULT) == UtilityResult(8, "pong")
    c.send(_request("after"))
    assert c.finish("after")


# --- through a real AsyncLLM ----------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def instant_llm():
    llm = await AsyncLLM(**INSTANT).start()
    yield llm
    process = llm.client.process
    await llm.shutdown()
    assert process.exit_code() == 0  # a full start/shutdown cycle of AsyncLLM
    assert not os.path.exists(process.ipc_dir)


async def _generate(llm: AsyncLLM, prompt: str, max_tokens: int = 3) -> list[int]:
    async def run() -> list[int]:
        outs = [o async for o in llm.generate(prompt, SamplingParams(max_tokens=max_tokens))]
        return list(outs[-1].outputs[0].token_ids)

    return await asyncio.wait_for(run(), GUARD_S)


@on_session_loop
@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda d: {**d, "max_tokens": "many"}, id="bad-field"),
        pytest.param(None, id="nested-too-deep"),
    ],
)
async def test_an_undecodable_request_fails_its_generator(instant_llm, monkeypatch, corrupt):
    """An ADD the core cannot decode, for a request the frontend registered: its
    generator raises ValueError (the core refuses it as INVALID), it does not hang."""
    client = instant_llm.client
    real = client.encoder

    class Corrupting:
        def encode(self, msg):
            if not isinstance(msg, EngineCoreRequest):
                return real.encode(msg)
            if corrupt is None:
                return [MsgKind.ADD.value, _with_deep_field(msg)]
            return [MsgKind.ADD.value, msgspec.msgpack.encode(corrupt(msgspec.to_builtins(msg)))]

    monkeypatch.setattr(client, "encoder", Corrupting())
    with pytest.raises(ValueError, match="malformed ADD"):
        await _generate(instant_llm, "Hello")
    monkeypatch.undo()
    assert len(await _generate(instant_llm, "Hello")) == 3
    assert instant_llm.is_running


@on_session_loop
async def test_deeply_nested_frames_leave_the_engine_serving(instant_llm):
    for body in (DEEP, DEEP_MAP, DEEP_CALL):
        for kind in (b"A", b"X", b"U"):
            instant_llm.client.input.send_multipart([kind, body])
    assert len(await _generate(instant_llm, "Still there?")) == 3
    await asyncio.wait_for(instant_llm.check_health(), GUARD_S)


# --- 8. the private socket folder -----------------------------------------------------

SCRIPT_HOLD = textwrap.dedent(
    """
    import sys, time
    from asyncllm.config import EngineArgs
    from asyncllm.engine.host_client import SyncMPClient

    args = EngineArgs(**{args!r})
    client = SyncMPClient(args)
    client.wait_ready()
    print(client.process.pid, client.process.ipc_dir, flush=True)
    time.sleep(600)
    """
)


@on_session_loop
async def test_a_killed_host_leaves_no_socket_folder_behind(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(SCRIPT_HOLD.format(args=INSTANT))
    src = Path(asyncllm.__file__).parents[1]  # the asyncllm this test imported
    env = {**os.environ, "PYTHONPATH": f"{src}:{ROOT / 'kernels'}", "OMP_NUM_THREADS": "1"}
    host = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(host.stdout.readline), 120)
        pid, folder = line.split()
        assert _pid_alive(int(pid)) and sorted(os.listdir(folder)) == ["in", "out"]
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
        host.stdout.close()
    try:
        deadline = time.monotonic() + GUARD_S
        while _pid_alive(int(pid)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _pid_alive(int(pid)), "the engine core outlived its host"
        assert not os.path.exists(folder), f"{folder} was left behind"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_only_a_folder_like_ours_is_removed(tmp_path):
    from asyncllm.engine.host_launcher import remove_private_ipc_dir

    def addrs(d):
        return f"ipc://{d}/in", f"ipc://{d}/out"

    other = tmp_path / "not-ours"
    other.mkdir()
    assert not remove_private_ipc_dir(*addrs(other)) and other.exists()
    crowded = tmp_path / "allm-crowded"
    crowded.mkdir()
    (crowded / "in").write_text("a plain file, not a socket")
    assert not remove_private_ipc_dir(*addrs(crowded)) and crowded.exists()
    assert not remove_private_ipc_dir(f"ipc://{crowded}/in", f"ipc://{other}/out")
    assert not remove_private_ipc_dir("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556")
    empty = tmp_path / "allm-empty"
    empty.mkdir()
    assert remove_private_ipc_dir(*addrs(empty)) and not empty.exists()


# --- the codec's part: naming what an undecodable message was for ---------------------


def test_a_request_id_is_read_past_values_that_do_not_decode():
    from asyncllm.engine.serial import MalformedMessage, recover_id

    enc = msgspec.msgpack.encode
    # request_id after a value nested too deep and before one that is not msgpack at all
    body = b"\x83" + enc("junk") + DEEP + enc("request_id") + enc("r1") + enc("x") + b"\xc1"
    assert recover_id(MsgKind.ADD, body) == "r1"
    with pytest.raises(MalformedMessage, match="RecursionError") as info:
        Decoder([MsgKind.ADD]).decode([b"A", body])
    assert info.value.kind is MsgKind.ADD and info.value.ident == "r1"
    assert recover_id(MsgKind.ADD, _with_deep_field(_request("r2"))) == "r2"
    assert recover_id(MsgKind.UTILITY, DEEP_CALL) == CALL_ID
    for kind, unreadable in [
        (MsgKind.ADD, DEEP),  # not a map
        (MsgKind.ADD, b""),
        (MsgKind.ADD, b"\x81\xaarequest_id"),  # its value is missing
        (MsgKind.ADD, b"\x81\xaarequest_id\x07"),  # not a str
        (MsgKind.ADD, b"\xdf\xff\xff\xff\xff"),  # a huge map with nothing in it
        (MsgKind.UTILITY, b"\x93\xc3\xa3get\x90"),  # True is no call id
        (MsgKind.UTILITY, DEEP),
        (MsgKind.ABORT, b"\x91\x91\xa1a"),  # no id to read
    ]:
        assert recover_id(kind, unreadable) is None, unreadable[:20]
