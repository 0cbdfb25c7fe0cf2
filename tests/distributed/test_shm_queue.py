"""The shared-memory broadcast queue (distributed/shm_queue.py): one writer, every
message to every reader, intact and in order, through a ring of chunks in shared memory,
a socket for messages larger than a chunk, and TCP for readers on another machine.

Readers in other processes are fresh interpreters (`python -m` this module) that get
the queue's handle as msgpack, as the executor's workers will, and report on their
stdout. Nothing here sleeps and hopes: every wait is on a condition with a deadline."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import msgspec
import pytest

from asyncllm.distributed.shm_queue import QueueClosed, QueueHandle, ShmQueue

ROOT = Path(__file__).resolve().parents[2]

CHUNK = 4096
N_MESSAGES = 10_000


# --- the messages: each one's size, content and checksum follow from its number -------


def _size(i: int) -> int:
    if i % 53 == 0:
        return CHUNK + (i % 7) * 1500  # larger than a chunk: through the socket
    return (i * 7919) % 1500


def _body(i: int) -> bytes:
    n = _size(i)
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def _send(queue: ShmQueue, i: int) -> None:
    body = _body(i)
    crc = zlib.crc32(body)
    if i % 3 == 0:  # plain data, msgpack by the queue
        queue.enqueue({"seq": i, "crc": crc, "body": body}, timeout=30)
    else:  # frames the caller encoded (an empty frame now and then)
        header = i.to_bytes(8, "little") + crc.to_bytes(4, "little")
        frames = [header, body, b""] if i % 5 == 0 else [header, memoryview(body)]
        queue.enqueue_frames(frames, timeout=30)


def _check(queue: ShmQueue, i: int) -> None:
    if i % 3 == 0:
        msg = queue.dequeue(timeout=30)
        seq, crc, body = msg["seq"], msg["crc"], msg["body"]
    else:
        frames = queue.dequeue_frames(timeout=30)
        assert len(frames) == (3 if i % 5 == 0 else 2), f"message {i}: {len(frames)} frames"
        seq = int.from_bytes(frames[0][:8], "little")
        crc = int.from_bytes(frames[0][8:], "little")
        body = frames[1]
    assert seq == i, f"expected message {i}, got {seq}"
    assert zlib.crc32(body) == crc and body == _body(i), f"message {i} arrived damaged"


def _reader_main(handle_hex: str, rank: int, n: int, stall: bool) -> None:
    """A reader process: attach, check n messages, print {"n", "s"} or {"error"}; with
    `stall`, say so after n messages and then wait for more until killed."""
    handle = msgspec.msgpack.decode(bytes.fromhex(handle_hex), type=QueueHandle)
    queue = ShmQueue.attach(handle, rank)
    try:
        started = time.monotonic()
        for i in range(n):
            _check(queue, i)
        print(json.dumps({"n": n, "s": time.monotonic() - started}), flush=True)
        if stall:
            queue.dequeue_frames()  # (blocks: the writer sends nothing more while we live)
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        print(json.dumps({"error": f"reader {rank}: {type(e).__name__}: {e}"}), flush=True)
    finally:
        queue.close()


def _start(writer: ShmQueue, rank: int, n: int, stall: bool = False) -> subprocess.Popen[str]:
    handle = msgspec.msgpack.encode(writer.export_handle()).hex()
    return subprocess.Popen(
        [sys.executable, "-m", "tests.distributed.test_shm_queue", handle, str(rank), str(n)]
        + (["stall"] if stall else []),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def _report(proc: subprocess.Popen[str], timeout: float) -> dict:
    """The reader's report line, waited for with a deadline."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"reader process {proc.pid} reported nothing in {timeout} s"
    line = proc.stdout.readline()
    assert line, f"reader process {proc.pid} ended with {proc.wait()} and no report"
    report = json.loads(line)
    assert "error" not in report, report["error"]
    return report


def _reap(procs: list[subprocess.Popen[str]]) -> list[int]:
    codes = []
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        codes.append(proc.returncode)
    return codes


def _shm_left(handle: QueueHandle) -> list[str]:
    left = []
    if handle.shm_name and os.path.exists(f"/dev/shm/{handle.shm_name}"):
        left.append(handle.shm_name)
    if handle.local_address and os.path.exists(handle.local_address.removeprefix("ipc://")):
        left.append(handle.local_address)
    return left


def _ours() -> set[str]:
    """The names in /dev/shm and the ipc sockets in the temporary folder of the queues
    this process created (a queue's name holds its creator's pid; other processes'
    queues, those of tests running beside this one, are not this test's)."""
    names = set()
    prefix = f"asyncllm_shmq_{os.getpid()}_"
    for folder in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(folder):
            names |= {f"{folder}/{n}" for n in os.listdir(folder) if n.startswith(prefix)}
    return names


@pytest.fixture
def shm_dir_unchanged():
    """Whatever a test leaves in /dev/shm (or an ipc socket file) fails it."""
    before = _ours()
    yield
    left = _ours() - before
    assert not left, f"left behind: {left}"


# --- four processes, ten thousand messages --------------------------------------------


def test_four_processes_ten_thousand_messages_arrive_intact_and_in_order(shm_dir_unchanged):
    """One writer and 3 reader processes on a ring of 16 chunks of 4 KiB: messages of
    0 to 13 KiB (one in 53 larger than a chunk, through the socket), as plain data and as
    frames; each reader checks every message's number, checksum and content. The ring
    holds the writer at most 16 messages ahead of the slowest reader, and the back-off
    lets 4 processes share 2 cores."""
    writer = ShmQueue(3, name="acceptance", n_chunks=16, chunk_bytes=CHUNK)
    handle = writer.export_handle()
    procs = [_start(writer, rank, N_MESSAGES) for rank in range(3)]
    try:
        writer.wait_for_readers(timeout=60)
        # Every reader has mapped the segment: its name is gone already.
        assert not _shm_left(handle)
        started = time.monotonic()
        for i in range(N_MESSAGES):
            _send(writer, i)
        wrote = time.monotonic() - started
        reports = [_report(proc, 60) for proc in procs]
        assert [r["n"] for r in reports] == [N_MESSAGES] * 3
        print(f"writer {wrote:.2f} s; readers {[round(r['s'], 2) for r in reports]} s")
    finally:
        codes = _reap(procs)
        writer.close()
    assert codes == [0, 0, 0]


def test_a_remote_reader_gets_every_message_over_tcp(shm_dir_unchanged):
    """A remote reader (another machine's, here a process on 127.0.0.1) receives every
    message over TCP, never attaching the segment, alongside a local reader."""
    writer = ShmQueue(1, 1, name="remote", n_chunks=8, chunk_bytes=CHUNK, remote_host="127.0.0.1")
    handle = writer.export_handle()
    assert handle.remote_address and handle.remote_address.startswith("tcp://127.0.0.1:")
    n = 2000
    procs = [_start(writer, rank, n) for rank in (0, 1)]
    try:
        writer.wait_for_readers(timeout=60)
        for i in range(n):
            _send(writer, i)
        assert [_report(proc, 60)["n"] for proc in procs] == [n, n]
    finally:
        codes = _reap(procs)
        writer.close()
    assert codes == [0, 0]
    assert not _shm_left(handle)


def test_a_killed_reader_does_not_hold_the_writer_forever(shm_dir_unchanged):
    """A reader process killed mid-way leaves its read flags behind: the writer fills
    the ring, then its timeout fires naming that reader."""
    writer = ShmQueue(2, name="killed", n_chunks=4, chunk_bytes=CHUNK)
    proc = _start(writer, 1, 3, stall=True)
    survivor = ShmQueue.attach(writer.export_handle(), 0)
    try:
        for i in range(3):
            _send(writer, i)
            _check(survivor, i)
        assert _report(proc, 60)["n"] == 3
        proc.send_signal(signal.SIGKILL)
        assert _reap([proc]) == [-signal.SIGKILL]
        for i in range(3, 7):  # (the ring's 4 chunks: the dead reader read 0, 1 and 2)
            _send(writer, i)
            _check(survivor, i)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"'killed'.*reader\(s\) \[1\].*waited 0\.2"):
            writer.enqueue(7, timeout=0.2)
        assert time.monotonic() - started < 2
    finally:
        survivor.close()
        writer.close()


# --- waits: timeouts and closing ------------------------------------------------------


def test_timeouts_name_the_queue_and_how_long_they_waited(shm_dir_unchanged):
    """An empty queue's reader and a full ring's writer raise TimeoutError; the queue is
    as it was, and the same call succeeds once the other end moves."""
    with ShmQueue(2, 1, name="slow", n_chunks=2, chunk_bytes=256, remote_host="127.0.0.1") as w:
        h = w.export_handle()
        with (
            ShmQueue.attach(h, 0) as r0,
            ShmQueue.attach(h, 1) as r1,
            ShmQueue.attach(h, 2) as remote,
        ):
            with pytest.raises(
                TimeoutError, match=r"'slow': reader 0 waits for message 0: waited 0\.05"
            ):
                r0.dequeue(timeout=0.05)
            with pytest.raises(
                TimeoutError, match=r"'slow': reader 2 waits for message 0 on its socket"
            ):
                remote.dequeue(timeout=0.05)
            with pytest.raises(TimeoutError):
                r0.dequeue(timeout=0)
            w.enqueue("a", timeout=5)
            w.enqueue("b", timeout=5)
            assert r0.dequeue(timeout=5) == "a"
            with pytest.raises(TimeoutError, match=r"reader\(s\) \[1\] to read message 0"):
                w.enqueue("c", timeout=0.05)
            assert r1.dequeue() == "a"
            w.enqueue("c", timeout=5)  # (the timed-out message, again)
            assert [r0.dequeue(), r0.dequeue()] == ["b", "c"]
            assert [r1.dequeue(), r1.dequeue()] == ["b", "c"]
            assert [remote.dequeue(timeout=5) for _ in range(3)] == ["a", "b", "c"]


def _blocked(call) -> tuple[threading.Thread, list[BaseException]]:
    """Run `call` in a thread; what it raises lands in the list."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def test_closing_wakes_blocked_readers_after_they_take_what_was_written(shm_dir_unchanged):
    """A reader waiting with no timeout (on the ring, or on TCP) raises QueueClosed when
    the writer closes; a reader first takes every message written before the close."""
    w = ShmQueue(2, 1, name="closing", n_chunks=4, chunk_bytes=256, remote_host="127.0.0.1")
    h = w.export_handle()
    readers = [ShmQueue.attach(h, rank) for rank in range(3)]
    try:
        w.wait_for_readers(timeout=10)  # (a remote reader hears of the close once counted)
        w.enqueue("last")
        w.enqueue_frames([b"x" * 1000])  # (larger than a chunk: on the socket)
        for r in (readers[0], readers[2]):
            assert r.dequeue(timeout=5) == "last"
            assert r.dequeue_frames(timeout=5) == [b"x" * 1000]
        blocked = [_blocked(readers[0].dequeue), _blocked(readers[2].dequeue)]
        for thread, _ in blocked:
            thread.join(0.05)
            assert thread.is_alive()
        started = time.monotonic()
        w.close()
        for thread, raised in blocked:
            thread.join(5)
            assert not thread.is_alive()
            assert len(raised) == 1 and isinstance(raised[0], QueueClosed), raised
        assert time.monotonic() - started < 2
        # The reader that had not read yet still gets both messages, then the close.
        assert readers[1].dequeue(timeout=5) == "last"
        assert readers[1].dequeue_frames(timeout=5) == [b"x" * 1000]
        with pytest.raises(QueueClosed, match="'closing' is closed"):
            readers[1].dequeue(timeout=5)
        assert readers[1].closed and w.closed
    finally:
        for r in readers:
            r.close()
    assert not _shm_left(h)


def test_mark_closed_wakes_a_blocked_writer_from_another_thread(shm_dir_unchanged):
    """A monitor thread that finds a worker dead wakes the writer stuck on a full ring
    at once, rather than at its timeout; a closed queue takes nothing more."""
    w = ShmQueue(1, name="stuck", n_chunks=2, chunk_bytes=256)
    r = ShmQueue.attach(w.export_handle(), 0)
    try:
        w.enqueue(0)
        w.enqueue(1)
        thread, raised = _blocked(lambda: w.enqueue(2))
        thread.join(0.05)
        assert thread.is_alive()
        started = time.monotonic()
        w.mark_closed()
        thread.join(5)
        assert not thread.is_alive() and isinstance(raised[0], QueueClosed)
        assert time.monotonic() - started < 1
        with pytest.raises(QueueClosed):
            w.enqueue(3)
        assert r.closed  # (the closed word is in the shared header)
    finally:
        r.close()
        w.close()


# --- what travels: plain data, the engine's frames ------------------------------------


def test_the_engines_step_frames_travel_as_they_were_encoded(shm_dir_unchanged):
    """The executor sends `StepEncoder` frames: a small SchedulerOutput through a chunk
    and a large one (a thousand new requests) through the socket, decoded alike."""
    from asyncllm.engine.serial import StepDecoder, StepEncoder, StepKind
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.step_io import CachedRequestData, NewRequestData, SchedulerOutput

    def step(n: int) -> SchedulerOutput:
        new = [
            NewRequestData(f"r{i}", list(range(i, i + 20)), [], SamplingParams(), [[i]], 0)
            for i in range(n)
        ]
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={f"r{i}": 20 for i in range(n)},
            total_num_scheduled_tokens=20 * n,
            finished_req_ids={"gone"},
        )

    encoder, decoder = StepEncoder(), StepDecoder()
    with ShmQueue(1, name="steps", n_chunks=4, chunk_bytes=8192) as w:
        with ShmQueue.attach(w.export_handle(), 0) as r:
            for sent in (step(2), step(1000), step(3)):
                w.enqueue_frames(encoder.encode(sent), timeout=5)
                kind, got = decoder.decode(r.dequeue_frames(timeout=5))
                assert kind is StepKind.SCHEDULER_OUTPUT and got == sent


def test_the_handle_is_plain_data_and_each_end_keeps_to_its_role(shm_dir_unchanged):
    with ShmQueue(1, 1, name="roles", remote_host="127.0.0.1", chunk_bytes=1000) as w:
        handle = w.export_handle()
        again = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=QueueHandle)
        assert again == handle and handle.chunk_bytes == 1000 and handle.shm_name
        with pytest.raises(ValueError, match=r"reader_rank 2 is not in \[0, 2\)"):
            ShmQueue.attach(handle, 2)
        with ShmQueue.attach(again, 0) as r, ShmQueue.attach(again, 1) as remote:
            with pytest.raises(RuntimeError, match="not its writer"):
                r.enqueue(1)
            with pytest.raises(RuntimeError, match="reads nothing"):
                w.dequeue()
            w.enqueue({"a": [1, 2.5, None, "x"]}, timeout=5)
            for end in (r, remote):
                got = end.dequeue(timeout=5, as_type=dict[str, list[int | float | None | str]])
                assert got == {"a": [1, 2.5, None, "x"]}
    assert not _shm_left(handle)
    with pytest.raises(FileNotFoundError):
        ShmQueue.attach(handle, 0)  # (unlinked by the writer's close)
    with pytest.raises(ValueError, match="at least one reader"):
        ShmQueue(0)
    with pytest.raises(ValueError, match="remote_host"):
        ShmQueue(0, 1)


def test_a_remote_reader_that_falls_behind_holds_the_writer_back_and_loses_nothing():
    """A remote reader has no chunks to hold the writer: its socket does (XPUB_NODROP),
    once a thousand messages wait on each side; the writer's timeout then fires and the
    reader still gets every message, in order."""
    with ShmQueue(0, 1, name="behind", remote_host="127.0.0.1") as w:
        with ShmQueue.attach(w.export_handle(), 0) as r:
            w.wait_for_readers(timeout=10)
            body, sent = b"x" * 10_000, 0
            with pytest.raises(TimeoutError, match="a remote reader to take message"):
                for i in range(100_000):
                    w.enqueue_frames([i.to_bytes(4, "little"), body], timeout=0.2)
                    sent += 1
            assert 1000 <= sent < 100_000
            for i in range(sent):
                frames = r.dequeue_frames(timeout=5)
                assert int.from_bytes(frames[0], "little") == i and frames[1] == body
            w.enqueue_frames([b"next"], timeout=5)  # (the timed-out message's turn)
            assert r.dequeue_frames(timeout=5) == [b"next"]


def test_a_queue_of_remote_readers_only_needs_no_shared_memory():
    with ShmQueue(0, 2, name="tcp-only", remote_host="127.0.0.1", chunk_bytes=64) as w:
        assert w.export_handle().shm_name is None
        readers = [ShmQueue.attach(w.export_handle(), rank) for rank in (0, 1)]
        try:
            for i in range(50):
                w.enqueue_frames([bytes([i]) * i], timeout=5)
            for r in readers:
                assert [r.dequeue_frames(timeout=5) for _ in range(50)] == [
                    [bytes([i]) * i] for i in range(50)
                ]
        finally:
            for r in readers:
                r.close()


if __name__ == "__main__":
    _reader_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["stall"])
