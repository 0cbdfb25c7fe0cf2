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
of order, `fence()` (shm_end.py) stands between the payload and the flag on both sides: a lock's
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
import os
import tempfile
import uuid

import zmq

from asyncllm.distributed.shm_end import (
    CLOSE_FRAME,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_SLEEP_S,
    DEFAULT_N_CHUNKS,
    DEFAULT_SPIN_S,
    H_CHUNK_BYTES,
    H_MAGIC,
    H_N_CHUNKS,
    H_N_READERS,
    HEADER_BYTES,
    MAGIC,
    QueueClosed,
    QueueHandle,
    chunk_stride,
    untracked_shm,
    untracked_unlink,
)
from asyncllm.distributed.shm_reader import ReaderEnd
from asyncllm.distributed.shm_writer import WriterEnd


class ShmQueue(WriterEnd, ReaderEnd):
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
                flag_words, stride = chunk_stride(n_local_readers, chunk_bytes)
                # (the creator's pid in the name: a leftover segment names its process)
                shm_name = f"asyncllm_shmq_{os.getpid()}_{uuid.uuid4().hex[:12]}"
                self._shm = untracked_shm(shm_name, True, HEADER_BYTES + n_chunks * stride)
                self._map(n_chunks, n_local_readers, chunk_bytes)
                words = self._words
                assert words is not None
                words[H_N_CHUNKS] = n_chunks
                words[H_CHUNK_BYTES] = chunk_bytes
                words[H_N_READERS] = n_local_readers
                words[H_MAGIC] = MAGIC
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
                self._shm = untracked_shm(handle.shm_name)
                self._map(handle.n_chunks, handle.n_local_readers, handle.chunk_bytes)
                words = self._words
                assert words is not None
                found = [words[i] for i in (H_MAGIC, H_N_CHUNKS, H_CHUNK_BYTES, H_N_READERS)]
                want = [MAGIC, handle.n_chunks, handle.chunk_bytes, handle.n_local_readers]
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
                self._remote_sock.send(CLOSE_FRAME, zmq.NOBLOCK)
        for sock in (self._local_sock, self._remote_sock):
            if sock is not None:
                sock.close()
        self._local_sock = self._remote_sock = None
        self._pending_subs = {}
        if self._ctx is not None:
            self._ctx.term()  # (waits up to LINGER_MS for the close notice)
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
                untracked_unlink(shm)

    def __enter__(self) -> ShmQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        end = "writer" if self.is_writer else f"reader {self._rank}"
        return f"ShmQueue({self.name!r}, {end}, message {self._count})"


__all__ = ["DEFAULT_SPIN_S", "QueueClosed", "QueueHandle", "ShmQueue"]
