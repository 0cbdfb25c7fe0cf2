"""One end of a shared-memory broadcast queue (`asyncllm.distributed.shm_queue`): the
segment's layout constants, the resource tracker kept out of its life, and `QueueEnd`,
what the writer's and the readers' ends share (the mapping, the sockets, the closed
word, the waits). The protocol is described in shm_queue.py's docstring."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import zmq

logger = logging.getLogger("asyncllm.distributed.shm_queue")

Frame = bytes | bytearray | memoryview

DEFAULT_N_CHUNKS = 8
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SPIN_S = 1e-3
DEFAULT_MAX_SLEEP_S = 1e-3

MAGIC = int.from_bytes(b"asyshmq1", "little")
H_MAGIC, H_N_CHUNKS, H_CHUNK_BYTES, H_N_READERS, H_CLOSED = range(5)
HEADER_BYTES = 64
PAYLOAD_HEAD_BYTES = 16  # on_socket, n_frames
FIRST_NAP_S = 1e-5
POLL_SLICE_S = 0.01  # a reader blocked on a socket looks at the closed word this often
WARN_AFTER_S = 60.0
LINGER_MS = 500  # what close() gives a socket's last messages (the close notice)
CLOSE_FRAME = b"closed"  # a socket message's first frame: this, or the 8-byte seq

NEEDS_FENCE = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")
_fence_lock = threading.Lock()
_untracked_lock = threading.Lock()


def fence() -> None:
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


def byte_view(frame: Frame) -> memoryview:
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


def untracked_shm(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    with _untracked():
        if sys.version_info >= (3, 13):
            return SharedMemory(name, create, size, track=False)  # type: ignore[call-arg,unused-ignore]
        return SharedMemory(name, create, size)


def untracked_unlink(shm: SharedMemory) -> None:
    with _untracked(), contextlib.suppress(FileNotFoundError):
        shm.unlink()


def chunk_stride(n_local_readers: int, chunk_bytes: int) -> tuple[int, int]:
    """(flag words per chunk, bytes per chunk): flags padded to 64 bytes."""
    flag_words = -(-(1 + n_local_readers) // 8) * 8
    return flag_words, flag_words * 8 + chunk_bytes


class QueueEnd:
    """What both ends hold and do (see ShmQueue)."""

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
        self._flag_words, stride = chunk_stride(n_readers, chunk_bytes)
        self._stride_words = stride // 8
        size = HEADER_BYTES + n_chunks * stride
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
        sock.setsockopt(zmq.LINGER, LINGER_MS)
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
            return words is not None and words[H_CLOSED] != 0
        except ValueError:  # (released by close() in another thread)
            return True

    def mark_closed(self) -> None:
        """Close the queue for every end on this node: their waits raise `QueueClosed`
        within one back-off interval. Safe from any thread; releases nothing."""
        self._closed_here = True
        words = self._words
        if words is not None:
            with contextlib.suppress(ValueError):
                words[H_CLOSED] = 1

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
        nap = FIRST_NAP_S
        warn_at = started + WARN_AFTER_S
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
                warn_at = now + WARN_AFTER_S
            time.sleep(nap if deadline is None else max(0.0, min(nap, deadline - now)))
            nap = min(nap * 2, self._max_sleep_s)
