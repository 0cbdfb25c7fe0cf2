"""The wire format: msgpack through msgspec, never pickle.

A message is a multipart ZMQ frame list: [kind, payload, *buffers]. Only the structs of
`asyncllm.messages` are sent, each under its own kind; anything else is a `TypeError`
before a byte leaves. numpy arrays inside a message travel as raw buffers in their own
frames (no copy into the msgpack body): the body holds an ext record (dtype, shape,
frame index).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from asyncllm.messages import KIND_OF, MESSAGE_TYPES, MsgKind

_NDARRAY_EXT = 1


class Encoder:
    def __init__(self) -> None:
        self._buffers: list[memoryview] | None = None
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            assert self._buffers is not None
            arr = np.ascontiguousarray(obj)
            self._buffers.append(arr.data.cast("B"))
            frame = 1 + len(self._buffers)  # frames: kind, body, then the buffers
            meta = msgspec.msgpack.encode((arr.dtype.str, arr.shape, frame))
            return msgspec.msgpack.Ext(_NDARRAY_EXT, meta)
        if isinstance(obj, enum.Enum):
            return obj.value
        raise TypeError(f"cannot send {type(obj).__name__} over the wire")

    def encode(self, msg: msgspec.Struct) -> list[bytes | memoryview]:
        kind = KIND_OF.get(type(msg))
        if kind is None:
            raise TypeError(
                f"only asyncllm.messages structs go over the wire, not {type(msg).__name__}"
            )
        self._buffers = []
        try:
            body = self._enc.encode(msg)
            return [kind.value, body, *self._buffers]
        finally:
            self._buffers = None


class Decoder:
    """Decodes the message kinds one side expects (`messages.TO_CORE` or `FROM_CORE`)."""

    def __init__(self, kinds: Iterable[MsgKind]) -> None:
        self._frames: list[Any] = []
        self._decoders = {
            kind: msgspec.msgpack.Decoder(MESSAGE_TYPES[kind], ext_hook=self._ext_hook)
            for kind in kinds
        }

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _NDARRAY_EXT:
            raise ValueError(f"unknown ext type {code}")
        dtype, shape, index = msgspec.msgpack.decode(data)
        if not 2 <= index < len(self._frames):
            raise ValueError(f"array frame {index} is missing")
        return np.frombuffer(self._frames[index], dtype=np.dtype(dtype)).reshape(shape)

    def decode(self, frames: list[Any]) -> tuple[MsgKind, Any]:
        """Raises ValueError for anything that is not a well-formed message."""
        if len(frames) < 2:
            raise ValueError("a message has at least two frames")
        try:
            kind = MsgKind(bytes(frames[0]))
        except ValueError:
            raise ValueError(f"unknown message kind {bytes(frames[0])[:8]!r}") from None
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise ValueError(f"unexpected message kind {kind.name}")
        self._frames = frames
        try:
            return kind, decoder.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
            raise ValueError(f"malformed {kind.name} message: {e}") from None
        finally:
            self._frames = []
