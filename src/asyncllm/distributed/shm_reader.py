"""A reader's half of `ShmQueue` (`asyncllm.distributed.shm_queue`): the next message
from its chunk (or the socket a large one went over), counted read once consumed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from asyncllm.distributed.shm_end import (
    CLOSE_FRAME,
    HEADER_BYTES,
    NEEDS_FENCE,
    POLL_SLICE_S,
    QueueEnd,
    fence,
)


class ReaderEnd(QueueEnd):
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
        base = HEADER_BYTES // 8 + (k % self._n_chunks) * self._stride_words
        want = k + 1
        if words[base] != want:
            self._wait(
                lambda: words[base] == want,
                deadline,
                started,
                lambda: f"reader {self._rank} waits for message {k}",
            )
        if NEEDS_FENCE:
            fence()
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
            if NEEDS_FENCE:
                fence()
            words[base + 1 + rank] = want
            self._count = want

    def _recv(
        self, sock: zmq.Socket[bytes], k: int, deadline: float | None, started: float
    ) -> list[bytes]:
        while True:
            wait_s = POLL_SLICE_S
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
            if sock.poll(math.ceil(wait_s * 1000), zmq.POLLIN):
                frames = sock.recv_multipart()
                if frames[0] == CLOSE_FRAME:
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
