"""The writer's half of `ShmQueue` (`asyncllm.distributed.shm_queue`): a message into
its chunk (or onto the ipc socket), the remote readers' TCP copies, the readers'
subscriptions counted, the names removed once every local reader is in."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import zmq

from asyncllm.distributed.shm_end import (
    HEADER_BYTES,
    NEEDS_FENCE,
    PAYLOAD_HEAD_BYTES,
    Frame,
    QueueEnd,
    QueueHandle,
    byte_view,
    fence,
    untracked_unlink,
)


class WriterEnd(QueueEnd):
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
        views = [byte_view(f) for f in frames]
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
            base = HEADER_BYTES // 8 + (k % self._n_chunks) * self._stride_words
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
            size = PAYLOAD_HEAD_BYTES + 8 * len(views) + sum(v.nbytes for v in views)
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
            if NEEDS_FENCE:
                fence()
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
            untracked_unlink(self._shm)

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
