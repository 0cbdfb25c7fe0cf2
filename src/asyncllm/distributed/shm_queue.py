"""A broadcast queue from one writer to N readers: a ring of chunks in shared memory.

The multiprocess executor sends each step's scheduler output to every worker in one
write: the writer copies a message into a chunk once, and every reader on the node reads
it from there (no socket, no copy per reader, no pickle). Results come back the same way
on a second queue whose writer is the worker that has them.

Roles. The process that builds a `ShmQueue` is its writer and owns its resources: the
shared-memory segment, a ZMQ XPUB socket over ipc:// for messages larger than a chunk,
and, with remote readers, a ZMQ XPUB socket over tcp://. `export_handle()` gives a
`QueueHandle` (a msgspec struct, plain data: send it to a reader any way) and
`ShmQueue.attach(handle, reader_rank)` opens the reader's end. Readers 0 ..
n_local_readers - 1 read the shared memory; the readers after them are remote (another
machine, e.g. a Ray worker): they receive every message over TCP and never touch the
segment. One thread per end; the only calls meant for another thread are
`mark_closed()` and reading `closed`.

Layout of the segment (every number a little-endian u64; the mmap is page-aligned, so
every word is 8-byte aligned):

    header, 64 bytes:  magic | n_chunks | chunk_bytes | n_local_readers | closed | 0 ...
    chunk c, at 64 + c * stride:
        flags, padded to a multiple of 64 bytes:
            written            = k + 1 once message k is in this chunk
            read[r], r < N     = k + 1 once reader r has read message k
        payload, chunk_bytes:
            on_socket (0 or 1) | n_frames | len(frame 0) ... len(frame n-1) | bytes ...

Message k (counted from 0 by both ends) goes to chunk k % n_chunks. The flags are
sequence numbers, not booleans, so no state repeats (no ABA): a written flag of k + 1
cannot be mistaken for the chunk's previous occupant k + 1 - n_chunks, and every test
is an equality with the one value expected next.

Protocol.
- The writer, for message k in chunk c: waits until every read[r] of c equals
  k + 1 - n_chunks (every reader has read the previous occupant; 0 on the ring's first
  round), writes the payload, then sets written = k + 1. So a chunk is never reused
  before every reader has read it.
- Reader r, for message k: waits until written of chunk c equals k + 1, reads the
  payload, then sets read[r] = k + 1. Readers read in order, each at its own pace; the
  writer runs at most n_chunks messages ahead of the slowest.
- A message larger than a chunk (`16 + 8 * n_frames + its bytes > chunk_bytes`) goes
  over the ipc socket, its chunk carrying only on_socket = 1 (written after the send,
  as any payload); the reader that meets it receives the next socket message, which
  names its sequence number (a lost or reordered message is an error, never silent).
  Order is the chunks' order, and the ring bounds the socket's backlog to n_chunks.

Memory ordering. The writer stores the payload, then the flag; a reader loads the flag,
then the payload, then stores its read flag. In CPython each of these is its own C
call run to completion in program order (a memcpy for the payload, one aligned 8-byte
store for `memoryview.cast("Q")[i] = v`), so the compiler cannot move the flag's store
before the payload's. On x86-64 (TSO) stores become visible in program order and loads
are not reordered with older loads nor stores with older loads, which is exactly what
the protocol needs: a reader that sees written = k + 1 sees the payload, and the writer
that sees read[r] = k + 1 knows the reader's loads of that payload are done. On weaker
memory models (ARM, POWER), where stores to different addresses may become visible out
of order, `_fence()` stands between the payload and the flag on both sides: a lock's
acquire and release, the one barrier pure Python reaches (CPython's locks are atomic
read-modify-writes with acquire and release semantics, and on ARMv8 a release followed
by an acquire is not reordered, so the pair orders what comes before it against what
comes after); on x86-64 it is skipped. This path is argued, not tested: the suite runs
on x86-64. An aligned 8-byte store is not torn on any 64-bit machine CPython runs on;
and since every test is an equality with the next sequence number, even a torn read
could only delay a wait, never pass it early.

Remote readers. Every message is published on the TCP socket with its sequence number
in a first frame. XPUB_NODROP makes a reader whose queues are full (1000 messages at
each end) push back on the writer instead of losing messages. A subscriber only receives what is
published after its subscription arrived, so the writer counts the subscriptions (XPUB
passes each one up) before the first send on each socket.

Waiting. Every wait spins briefly (`spin_s`, yielding the CPU at each turn), then sleeps
with intervals that double from 10 us up to `max_sleep_s`: idle ends cost no CPU, and
more ranks than cores still progress. A long spin suits an end whose message comes soon
and that has a core of its own (a GPU worker awaiting its next step); a short one, many
ranks on few cores. Every wait takes a `timeout` (None: forever) and raises
`TimeoutError` naming the queue, what it waited for and for how long (a writer names the
readers that hold the ring: a reader that died leaves its flag behind). Every wait also
ends with `QueueClosed` once the queue is closed: the closed word in the header, set by
`mark_closed()` or `close()` in any process of the node, is checked at each turn (a
reader first takes the messages already written). Remote readers hear of the close from
a last message on their socket.

Teardown. A POSIX segment lives on while mapped after its name is removed, so the
writer removes the segment's name, and the ipc socket's file, as soon as every local
reader has attached (a reader subscribes after it has mapped the segment; the writer
counts them in `wait_for_readers()`, or in passing at each `enqueue` until all are in):
from then on nothing is left in /dev/shm whatever dies, SIGKILL included. `close()`
marks the queue closed, closes the sockets (the remote readers' close notice gets up to
0.5 s to leave) and the mapping, and removes the names if that had not happened yet.
`multiprocessing`'s resource tracker is kept out of it: it would start a process of its
own that outlives the queue, and a reader's tracker would unlink the segment when that
reader exits. A writer killed before its readers attached leaves its segment behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

Frame = bytes | bytearray | memoryview

DEFAULT_N_CHUNKS = 8
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SPIN_S = 1e-3
DEFAULT_MAX_SLEEP_S = 1e-3

_MAGIC = int.from_bytes(b"asyshmq1", "little")
_H_MAGIC, _H_N_CHUNKS, _H_CHUNK_BYTES, _H_N_READERS, _H_CLOSED = range(5)
_HEADER_BYTES = 64
_PAYLOAD_HEAD_BYTES = 16  # on_socket, n_frames
_FIRST_NAP_S = 1e-5
_POLL_SLICE_S = 0.01  # a reader blocked on a socket looks at the closed word this often
_WARN_AFTER_S = 60.0
_LINGER_MS = 500  # what close() gives a socket's last messages (the close notice)
_CLOSE_FRAME = b"closed"  # a socket message's first frame: this, or the 8-byte seq

_NEEDS_FENCE = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")
_fence_lock = threading.Lock()
_untracked_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier on machines weaker than TSO (see the module docstring)."""
    with _fence_lock:
        pass


class QueueClosed(RuntimeError):
    """The queue was closed while (or before) this end waited on it."""


class QueueHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader needs to attach: plain data, msgspec-encodable."""

    name: str
    shm_name: str | None  # None without local readers
    n_chunks: int
    chunk_bytes: int
    n_local_readers: int
    n_remote_readers: int
    local_address: str | None  # ipc://, for messages larger than a chunk
    remote_address: str | None  # tcp://host:port, every message for remote readers
    spin_s: float = DEFAULT_SPIN_S
    max_sleep_s: float = DEFAULT_MAX_SLEEP_S


def _byte_view(frame: Frame) -> memoryview:
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    """Keep `multiprocessing`'s resource tracker out of a segment's life: the queue
    unlinks its name itself (see Teardown), while a tracker would start a process of
    its own that outlives the queue, and unlink the segment when a reader exits. Python
    3.13 says so with `track=False`; before it, the tracker's calls are muted."""
    if sys.version_info >= (3, 13):
        yield
        return
    with _untracked_lock:  # (another thread's SharedMemory() in this instant goes untracked)
        register, unregister = resource_tracker.register, resource_tracker.unregister
        setattr(resource_tracker, "register", lambda name, rtype: None)  # noqa: B010
        setattr(resource_tracker, "unregister", lambda name, rtype: None)  # noqa: B010
        try:
            yield
        finally:
            setattr(resource_tracker, "register", register)  # noqa: B010
            setattr(resource_tracker, "unregister", unregister)  # noqa: B010


def _untracked_shm(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    with _untracked():
        if sys.version_info >= (3, 13):
            return SharedMemory(name, create, size, track=False)  # type: ignore[call-arg,unused-ignore]
        return SharedMemory(name, create, size)


def _untracked_unlink(shm: SharedMemory) -> None:
    with _untracked(), contextlib.suppress(FileNotFoundError):
        shm.unlink()


def _chunk_stride(n_local_readers: int, chunk_bytes: int) -> tuple[int, int]:
    """(flag words per chunk, bytes per chunk): flags padded to 64 bytes."""
    flag_words = -(-(1 + n_local_readers) // 8) * 8
    return flag_words, flag_words * 8 + chunk_bytes


class ShmQueue:
    """One writer, N readers; each message reaches every reader, in order.

    Writer: `ShmQueue(n_local_readers, n_remote_readers, ...)`, `export_handle()`,
    `enqueue(obj)` / `enqueue_frames(frames)`, `wait_for_readers()`, `close()`.
    Reader: `ShmQueue.attach(handle, reader_rank)`, `dequeue()` / `dequeue_frames()`,
    `close()`. `enqueue(obj)` sends msgspec msgpack of plain data (a struct, dataclass,
    dict, list, ...) and `dequeue()` decodes it; the `_frames` variants carry a list of
    byte frames the caller encoded itself (e.g. `asyncllm.engine.serial.Encoder`'s
    multipart frames), returned as `bytes`. A `TimeoutError` leaves the queue as it was:
    the message was neither sent nor taken, and the call may be repeated.
    """

    name: str
    _rank: int | None  # None: the writer
    _creator: bool
    _spin_s: float
    _max_sleep_s: float
    _count: int  # messages written (writer) or read (reader)
    _closed_here: bool
    _released: bool
    _unlinked: bool  # the writer has removed the segment's name
    _handle: QueueHandle
    _n_chunks: int
    _n_local: int
    _chunk_bytes: int
    _shm: SharedMemory | None
    _buf: memoryview | None
    _words: memoryview | None  # the segment as u64 words
    _flag_words: int  # per chunk, before its payload
    _stride_words: int
    _ctx: zmq.Context[zmq.Socket[bytes]] | None
    _local_sock: zmq.Socket[bytes] | None
    _remote_sock: zmq.Socket[bytes] | None
    _ipc_path: str | None
    _pending_subs: dict[zmq.Socket[bytes], int]  # subscriptions each socket still awaits
    _encoder: msgspec.msgpack.Encoder
    _decoders: dict[Any, msgspec.msgpack.Decoder[Any]]

    def __init__(
        self,
        n_local_readers: int,
        n_remote_readers: int = 0,
        *,
        name: str = "shm-queue",
        n_chunks: int = DEFAULT_N_CHUNKS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        remote_host: str | None = None,
        remote_port: int = 0,
        spin_s: float = DEFAULT_SPIN_S,
        max_sleep_s: float = DEFAULT_MAX_SLEEP_S,
    ) -> None:
        """A ring of `n_chunks` chunks of `chunk_bytes` (rounded up to 8) for
        `n_local_readers`, and a TCP socket for `n_remote_readers`, bound at
        `remote_host` (an IP address of this machine that they reach, required with
        remote readers) and `remote_port` (0: a free one). `spin_s` and `max_sleep_s`
        shape every wait (see Waiting); readers inherit them unless they choose."""
        if n_local_readers < 0 or n_remote_readers < 0 or n_local_readers + n_remote_readers < 1:
            raise ValueError(
                f"a queue needs at least one reader, not {n_local_readers} local "
                f"and {n_remote_readers} remote"
            )
        if n_chunks < 1:
            raise ValueError(f"n_chunks must be at least 1, not {n_chunks}")
        if chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, not {chunk_bytes}")
        if spin_s < 0 or max_sleep_s <= 0:
            raise ValueError(f"spin_s ({spin_s}) >= 0 and max_sleep_s ({max_sleep_s}) > 0")
        if n_remote_readers and not remote_host:
            raise ValueError("remote readers need remote_host (the address they reach us at)")
        chunk_bytes = -(-chunk_bytes // 8) * 8
        self._init_end(name, None, spin_s, max_sleep_s)
        self._creator = True
        shm_name = local_address = remote_address = None
        try:
            if n_local_readers:
                flag_words, stride = _chunk_stride(n_local_readers, chunk_bytes)
                # (the creator's pid in the name: a leftover segment names its process)
                shm_name = f"asyncllm_shmq_{os.getpid()}_{uuid.uuid4().hex[:12]}"
                self._shm = _untracked_shm(shm_name, True, _HEADER_BYTES + n_chunks * stride)
                self._map(n_chunks, n_local_readers, chunk_bytes)
                words = self._words
                assert words is not None
                words[_H_N_CHUNKS] = n_chunks
                words[_H_CHUNK_BYTES] = chunk_bytes
                words[_H_N_READERS] = n_local_readers
                words[_H_MAGIC] = _MAGIC
                path = os.path.join(tempfile.gettempdir(), f"{shm_name}.ipc")
                self._ipc_path = path
                self._local_sock = self._xpub(f"ipc://{path}", hwm=0)  # (the ring bounds it)
                local_address = f"ipc://{path}"
            if n_remote_readers:
                host = f"[{remote_host}]" if remote_host and ":" in remote_host else remote_host
                self._remote_sock = self._xpub(f"tcp://{host}:{remote_port or '*'}", hwm=None)
                remote_address = self._remote_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise
        self._pending_subs = {
            sock: n
            for sock, n in (
                (self._local_sock, n_local_readers),
                (self._remote_sock, n_remote_readers),
            )
            if sock is not None
        }
        self._handle = QueueHandle(
            name=name,
            shm_name=shm_name,
            n_chunks=n_chunks,
            chunk_bytes=chunk_bytes,
            n_local_readers=n_local_readers,
            n_remote_readers=n_remote_readers,
            local_address=local_address,
            remote_address=remote_address,
            spin_s=spin_s,
            max_sleep_s=max_sleep_s,
        )
        self._n_chunks = n_chunks
        self._n_local = n_local_readers
        self._chunk_bytes = chunk_bytes

    @classmethod
    def attach(
        cls,
        handle: QueueHandle,
        reader_rank: int,
        *,
        spin_s: float | None = None,
        max_sleep_s: float | None = None,
    ) -> ShmQueue:
        """Reader `reader_rank`'s end: ranks below `handle.n_local_readers` read the
        shared memory (this machine), the others the TCP socket. `spin_s` and
        `max_sleep_s` default to the writer's. Every reader attaches once, before the
        writer's `wait_for_readers()` returns (the segment's name is gone after it:
        FileNotFoundError)."""
        n = handle.n_local_readers + handle.n_remote_readers
        if not 0 <= reader_rank < n:
            raise ValueError(
                f"reader_rank {reader_rank} is not in [0, {n}) of queue {handle.name!r}"
            )
        self = cls.__new__(cls)
        self._init_end(
            handle.name,
            reader_rank,
            handle.spin_s if spin_s is None else spin_s,
            handle.max_sleep_s if max_sleep_s is None else max_sleep_s,
        )
        self._creator = False
        self._handle = handle
        self._n_chunks = handle.n_chunks
        self._n_local = handle.n_local_readers
        self._chunk_bytes = handle.chunk_bytes
        try:
            if reader_rank < handle.n_local_readers:
                assert handle.shm_name is not None and handle.local_address is not None
                self._shm = _untracked_shm(handle.shm_name)
                self._map(handle.n_chunks, handle.n_local_readers, handle.chunk_bytes)
                words = self._words
                assert words is not None
                found = [words[i] for i in (_H_MAGIC, _H_N_CHUNKS, _H_CHUNK_BYTES, _H_N_READERS)]
                want = [_MAGIC, handle.n_chunks, handle.chunk_bytes, handle.n_local_readers]
                if found != want:
                    raise ValueError(f"segment {handle.shm_name} is not queue {handle.name!r}'s")
                self._local_sock = self._sub(handle.local_address, hwm=0)
            else:
                assert handle.remote_address is not None
                self._remote_sock = self._sub(handle.remote_address, hwm=None)
        except BaseException:
            self.close()
            raise
        return self

    def _init_end(self, name: str, rank: int | None, spin_s: float, max_sleep_s: float) -> None:
        self.name = name
        self._rank = rank
        self._spin_s = spin_s
        self._max_sleep_s = max_sleep_s
        self._count = 0
        self._closed_here = False
        self._released = False
        self._unlinked = False
        self._shm = None
        self._buf = None
        self._words = None
        self._flag_words = 0
        self._stride_words = 0
        self._ctx = None
        self._local_sock = None
        self._remote_sock = None
        self._ipc_path = None
        self._pending_subs = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {}

    def _map(self, n_chunks: int, n_readers: int, chunk_bytes: int) -> None:
        assert self._shm is not None
        self._flag_words, stride = _chunk_stride(n_readers, chunk_bytes)
        self._stride_words = stride // 8
        size = _HEADER_BYTES + n_chunks * stride
        if self._shm.size < size:
            raise ValueError(f"segment {self._shm.name} holds {self._shm.size} bytes, not {size}")
        buf = self._shm.buf
        assert buf is not None
        self._buf = buf
        self._words = buf[:size].cast("Q")

    def _context(self) -> zmq.Context[zmq.Socket[bytes]]:
        if self._ctx is None:
            self._ctx = zmq.Context(io_threads=1)
        return self._ctx

    def _xpub(self, address: str, hwm: int | None) -> zmq.Socket[bytes]:
        sock = self._context().socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's subscription, to count them
        sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full reader pushes back, never loses one
        if hwm is not None:
            sock.setsockopt(zmq.SNDHWM, hwm)
        sock.bind(address)
        return sock

    def _sub(self, address: str, hwm: int | None) -> zmq.Socket[bytes]:
        sock = self._context().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        return sock

    # --- both ends -------------------------------------------------------------------

    @property
    def is_writer(self) -> bool:
        return self._rank is None

    @property
    def reader_rank(self) -> int | None:
        return self._rank

    @property
    def closed(self) -> bool:
        """Whether the queue was closed, here or (local ends) in any process."""
        if self._closed_here:
            return True
        words = self._words
        try:
            return words is not None and words[_H_CLOSED] != 0
        except ValueError:  # (released by close() in another thread)
            return True

    def mark_closed(self) -> None:
        """Close the queue for every end on this node: their waits raise `QueueClosed`
        within one back-off interval. Safe from any thread; releases nothing."""
        self._closed_here = True
        words = self._words
        if words is not None:
            with contextlib.suppress(ValueError):
                words[_H_CLOSED] = 1

    def close(self, *, unlink: bool = False) -> None:
        """Mark the queue closed (for every end: a broadcast with an end gone cannot go
        on), tell remote readers, close the sockets and the mapping; the writer removes
        the names of the segment and of its ipc socket if its readers had not all
        attached yet. A reader may pass `unlink=True` to remove the segment's name, for
        a writer that died before that. Call it from the thread that uses this end
        (another thread uses `mark_closed()`). Idempotent."""
        if self._released:
            return
        self._released = True
        self.mark_closed()
        if self.is_writer and self._remote_sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._remote_sock.send(_CLOSE_FRAME, zmq.NOBLOCK)
        for sock in (self._local_sock, self._remote_sock):
            if sock is not None:
                sock.close()
        self._local_sock = self._remote_sock = None
        self._pending_subs = {}
        if self._ctx is not None:
            self._ctx.term()  # (waits up to _LINGER_MS for the close notice)
            self._ctx = None
        if self._creator:
            self._unlink_names()
        if self._words is not None:
            self._words.release()
            self._words = None
        self._buf = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()
            if unlink and not self._creator:
                _untracked_unlink(shm)

    def __enter__(self) -> ShmQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        end = "writer" if self.is_writer else f"reader {self._rank}"
        return f"ShmQueue({self.name!r}, {end}, message {self._count})"

    def _closed_error(self) -> QueueClosed:
        return QueueClosed(f"shm queue {self.name!r} is closed")

    def _wait(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        started: float,
        waiting_for: Callable[[], str],
    ) -> None:
        """Until `ready()`: spin, then sleep with doubling naps; raise `QueueClosed` once
        the queue is closed, `TimeoutError` past `deadline`."""
        spin_until = started + self._spin_s
        nap = _FIRST_NAP_S
        warn_at = started + _WARN_AFTER_S
        while True:
            try:
                if ready():
                    return
            except ValueError:  # (a memoryview released by close() in another thread)
                if self._closed_here:
                    raise self._closed_error() from None
                raise
            if self.closed:
                raise self._closed_error()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"shm queue {self.name!r}: {waiting_for()}: waited {now - started:.3g} s"
                )
            if now < spin_until:
                os.sched_yield()
                continue
            if now >= warn_at:
                logger.warning(
                    "shm queue %r: %s: still waiting after %.0f s",
                    self.name,
                    waiting_for(),
                    now - started,
                )
                warn_at = now + _WARN_AFTER_S
            time.sleep(nap if deadline is None else max(0.0, min(nap, deadline - now)))
            nap = min(nap * 2, self._max_sleep_s)

    # --- the writer ------------------------------------------------------------------

    def export_handle(self) -> QueueHandle:
        """What a reader passes to `ShmQueue.attach` (plain data)."""
        self._need_writer("export_handle")
        return self._handle

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj` (plain data) as msgspec msgpack to every reader."""
        self.enqueue_frames((self._encoder.encode(obj),), timeout)

    def enqueue_frames(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Send one message of byte frames (at least one) to every reader. Waits while
        the ring is full (the slowest local reader is n_chunks messages behind) or a
        remote reader's socket is."""
        self._need_writer("enqueue")
        if self.closed:
            raise self._closed_error()
        views = [_byte_view(f) for f in frames]
        if not views:
            raise ValueError("a message has at least one frame")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        k = self._count
        words = self._words
        on_socket = False
        local = self._local_sock
        if local is not None and local in self._pending_subs:  # (until every reader is in)
            self._take_subscriptions(local)
        if words is not None:
            base = _HEADER_BYTES // 8 + (k % self._n_chunks) * self._stride_words
            prev = max(0, k + 1 - self._n_chunks)
            readers = range(base + 1, base + 1 + self._n_local)
            if any(words[i] != prev for i in readers):

                def lagging() -> str:
                    late = [i - base - 1 for i in readers if words[i] != prev]
                    return (
                        f"the writer waits for reader(s) {late} to read message {k - self._n_chunks}"
                        f" (chunk {k % self._n_chunks}) before writing message {k}"
                    )

                self._wait(
                    lambda: all(words[i] == prev for i in readers), deadline, started, lagging
                )
            size = _PAYLOAD_HEAD_BYTES + 8 * len(views) + sum(v.nbytes for v in views)
            on_socket = size > self._chunk_bytes
            if on_socket:
                assert self._local_sock is not None
                self._await_subscribers(self._local_sock, deadline, started)
        header = k.to_bytes(8, "little")
        # Nothing is committed before this point (a timeout leaves the queue as it was);
        # the remote send is the one commit that may wait, so it goes first.
        if self._remote_sock is not None:
            self._await_subscribers(self._remote_sock, deadline, started)
            self._send(self._remote_sock, [header, *views], deadline, started, k)
        if words is not None:
            p = base + self._flag_words
            if on_socket:
                assert self._local_sock is not None
                self._local_sock.send_multipart([header, *views], copy=True)
                words[p] = 1
            else:
                self._write_payload(p, views)
            if _NEEDS_FENCE:
                _fence()
            words[base] = k + 1
        self._count = k + 1

    def _write_payload(self, p: int, views: list[memoryview]) -> None:
        words, buf = self._words, self._buf
        assert words is not None and buf is not None
        n = len(views)
        words[p] = 0
        words[p + 1] = n
        for i, v in enumerate(views):
            words[p + 2 + i] = v.nbytes
        off = (p + 2 + n) * 8
        for v in views:
            end = off + v.nbytes
            buf[off:end] = v
            off = end

    def _send(
        self,
        sock: zmq.Socket[bytes],
        frames: list[Any],
        deadline: float | None,
        started: float,
        k: int,
    ) -> None:
        def sent() -> bool:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return False
            return True

        self._wait(
            sent,
            deadline,
            started,
            lambda: f"the writer waits for a remote reader to take message {k}",
        )

    def _await_subscribers(
        self, sock: zmq.Socket[bytes], deadline: float | None, started: float
    ) -> None:
        """A reader subscribes as it attaches; a message published before its
        subscription arrives would never reach it, so the first send on each socket
        waits for all of them."""
        if sock not in self._pending_subs:
            return
        what = "remote" if sock is self._remote_sock else "local"
        self._wait(
            lambda: self._take_subscriptions(sock),
            deadline,
            started,
            lambda: f"the writer waits for {self._pending_subs[sock]} {what} reader(s) to attach",
        )

    def _take_subscriptions(self, sock: zmq.Socket[bytes]) -> bool:
        """Count the subscriptions that arrived (without waiting); True once all have.
        A local reader subscribes after it has mapped the segment: once all have, the
        names of the segment and of the ipc socket go (see Teardown)."""
        while sock.poll(0, zmq.POLLIN):
            if sock.recv()[:1] == b"\x01":
                self._pending_subs[sock] -= 1
        if self._pending_subs[sock] > 0:
            return False
        del self._pending_subs[sock]
        if sock is self._local_sock:
            self._unlink_names()
        return True

    def _unlink_names(self) -> None:
        if self._ipc_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)
            self._ipc_path = None
        if self._shm is not None and not self._unlinked:
            self._unlinked = True
            _untracked_unlink(self._shm)

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Wait until every reader has attached (its socket subscribed): the writer does
        so by itself before the first message that needs a socket; a writer that must
        know its readers are there (or that remote readers hear a close) asks here."""
        self._need_writer("wait_for_readers")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        for sock in list(self._pending_subs):
            self._await_subscribers(sock, deadline, started)

    def _need_writer(self, what: str) -> None:
        if not self.is_writer:
            raise RuntimeError(
                f"{what}: reader {self._rank} of shm queue {self.name!r} is not its writer"
            )

    # --- a reader --------------------------------------------------------------------

    def dequeue(self, timeout: float | None = None, *, as_type: Any = Any) -> Any:
        """The next message `enqueue` sent, decoded (as `as_type`, a msgspec type)."""
        decoder = self._decoders.get(as_type)
        if decoder is None:
            decoder = self._decoders[as_type] = msgspec.msgpack.Decoder(as_type)

        def decode(frames: list[Any]) -> Any:
            if len(frames) != 1:
                raise ValueError(
                    f"dequeue() takes one-frame messages; this one has {len(frames)} (dequeue_frames)"
                )
            return decoder.decode(frames[0])

        return self._read(decode, timeout)

    def dequeue_frames(self, timeout: float | None = None) -> list[bytes]:
        """The next message's frames (copies: the chunk is the writer's again at once)."""
        return self._read(lambda frames: [bytes(f) for f in frames], timeout)

    def _read(self, consume: Callable[[list[Any]], Any], timeout: float | None) -> Any:
        """Wait for message k, hand its frames to `consume`, then count it read (also
        when `consume` raises: a malformed message must not wedge the ring)."""
        if self.is_writer:
            raise RuntimeError(f"dequeue: the writer of shm queue {self.name!r} reads nothing")
        if self._released:
            raise self._closed_error()
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        k = self._count
        rank = self._rank
        assert rank is not None
        words = self._words
        if words is None:  # a remote reader
            assert self._remote_sock is not None
            received = self._recv(self._remote_sock, k, deadline, started)
            self._count = k + 1
            return consume(received)
        base = _HEADER_BYTES // 8 + (k % self._n_chunks) * self._stride_words
        want = k + 1
        if words[base] != want:
            self._wait(
                lambda: words[base] == want,
                deadline,
                started,
                lambda: f"reader {self._rank} waits for message {k}",
            )
        if _NEEDS_FENCE:
            _fence()
        p = base + self._flag_words
        views: list[memoryview] = []
        frames: list[Any]
        if words[p]:
            assert self._local_sock is not None
            frames = self._recv(self._local_sock, k, deadline, started)
        else:
            buf = self._buf
            assert buf is not None
            n = words[p + 1]
            off = (p + 2 + n) * 8
            for i in range(n):
                end = off + words[p + 2 + i]
                views.append(buf[off:end])
                off = end
            frames = views
        try:
            return consume(frames)
        finally:
            for v in views:
                v.release()
            if _NEEDS_FENCE:
                _fence()
            words[base + 1 + rank] = want
            self._count = want

    def _recv(
        self, sock: zmq.Socket[bytes], k: int, deadline: float | None, started: float
    ) -> list[bytes]:
        while True:
            wait_s = _POLL_SLICE_S
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
            if sock.poll(math.ceil(wait_s * 1000), zmq.POLLIN):
                frames = sock.recv_multipart()
                if frames[0] == _CLOSE_FRAME:
                    self._closed_here = True
                    raise self._closed_error()
                seq = int.from_bytes(frames[0], "little")
                if seq != k:
                    raise RuntimeError(
                        f"shm queue {self.name!r}: reader {self._rank} expected message {k} on its socket, got {seq}"
                    )
                return frames[1:]
            if self.closed:
                raise self._closed_error()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"shm queue {self.name!r}: reader {self._rank} waits for message {k}"
                    f" on its socket: waited {now - started:.3g} s"
                )


__all__ = ["QueueClosed", "QueueHandle", "ShmQueue"]
