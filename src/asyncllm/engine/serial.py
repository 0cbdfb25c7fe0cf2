"""The wire format: msgpack through msgspec, never pickle.

A message is a multipart ZMQ frame list: [kind, payload, *buffers]. numpy arrays
travel as raw buffers in their own frames (no copy into the msgpack body): the body
holds an ext record (dtype, shape, frame index).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

_NDARRAY_EXT = 1


class MsgKind(bytes, enum.Enum):
    # frontend -> core
    CONFIG = b"C"
    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    # core -> frontend
    READY = b"R"
    OUTPUTS = b"O"
    UTILITY_RESULT = b"V"
    DEAD = b"D"


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class Encoder:
    def __init__(self) -> None:
        self._buffers: list[memoryview] | None = None
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            assert self._buffers is not None
            arr = np.ascontiguousarray(obj)
            self._buffers.append(memoryview(arr).cast("B"))
            frame = 1 + len(self._buffers)  # frames: kind, body, then the buffers
            meta = msgspec.msgpack.encode((arr.dtype.str, arr.shape, frame))
            return msgspec.msgpack.Ext(_NDARRAY_EXT, meta)
        if isinstance(obj, enum.Enum):
            return obj.value
        raise TypeError(f"cannot send {type(obj).__name__} over the wire")

    def encode(self, kind: MsgKind, obj: Any) -> list[bytes | memoryview]:
        self._buffers = []
        try:
            body = self._enc.encode(obj)
            return [kind.value, body, *self._buffers]
        finally:
            self._buffers = None


class Decoder:
    def __init__(self, types: dict[MsgKind, Any]) -> None:
        self._frames: list[Any] = []
        self._decoders = {
            kind: msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook) for kind, t in types.items()
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
