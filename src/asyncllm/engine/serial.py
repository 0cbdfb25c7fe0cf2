"""The wire format: msgpack through msgspec, never pickle.

A message is a multipart ZMQ frame list: [kind, payload, *buffers]. Only the structs of
`asyncllm.messages` are sent, each under its own kind; anything else is a `TypeError`
before a byte leaves. numpy arrays inside a message travel as raw buffers in their own
frames (no copy into the msgpack body): the body holds an ext record (dtype, shape,
frame index).

Between the engine core and its workers the step data go the same way under their own
kinds (`StepEncoder`, `StepDecoder`): `SchedulerOutput` and `ModelRunnerOutput`
(step_io.py, plain dataclasses; sets travel as arrays and come back as sets).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import msgspec
import numpy as np

from asyncllm.messages import KIND_OF, MESSAGE_TYPES, MsgKind
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput

_NDARRAY_EXT = 1


class StepKind(bytes, enum.Enum):
    """The kinds of the step data between the engine core and its workers (a wire of
    their own: never mixed with the client's messages)."""

    SCHEDULER_OUTPUT = b"s"
    RUNNER_OUTPUT = b"r"


STEP_TYPES: dict[StepKind, type] = {
    StepKind.SCHEDULER_OUTPUT: SchedulerOutput,
    StepKind.RUNNER_OUTPUT: ModelRunnerOutput,
}


class Encoder:
    """Encodes the structs of `asyncllm.messages` (or of `kinds`: type -> kind)."""

    def __init__(self, kinds: Mapping[type, bytes] = KIND_OF) -> None:
        self._kinds = kinds
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

    def encode(self, msg: Any) -> list[bytes | memoryview]:
        kind = self._kinds.get(type(msg))
        if kind is None:
            what = "asyncllm.messages structs" if self._kinds is KIND_OF else "step data"
            raise TypeError(f"only {what} go over the wire, not {type(msg).__name__}")
        self._buffers = []
        try:
            body = self._enc.encode(msg)
            return [bytes(kind), body, *self._buffers]
        finally:
            self._buffers = None


class Decoder:
    """Decodes the message kinds one side expects (`messages.TO_CORE` or `FROM_CORE`;
    `types`: kind -> type, for another wire)."""

    def __init__(
        self,
        kinds: Iterable[Any],
        types: Mapping[Any, type] = MESSAGE_TYPES,
        kind_enum: Any = MsgKind,
    ) -> None:
        self._frames: list[Any] = []
        self._kind_enum = kind_enum
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {
            kind: msgspec.msgpack.Decoder(types[kind], ext_hook=self._ext_hook) for kind in kinds
        }

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _NDARRAY_EXT:
            raise ValueError(f"unknown ext type {code}")
        dtype, shape, index = msgspec.msgpack.decode(data)
        if not 2 <= index < len(self._frames):
            raise ValueError(f"array frame {index} is missing")
        return np.frombuffer(self._frames[index], dtype=np.dtype(dtype)).reshape(shape)

    def decode(self, frames: list[Any]) -> tuple[MsgKind, Any]:
        """Raises MalformedMessage (a ValueError) for anything that is not a well-formed
        message, whatever decoding it raised (a RecursionError for deep nesting included);
        it names the request or call the message was for, when that can be read."""
        if len(frames) < 2:
            raise MalformedMessage("a message has at least two frames")
        try:
            kind = self._kind_enum(bytes(frames[0]))
        except ValueError:
            raise MalformedMessage(f"unknown message kind {bytes(frames[0])[:8]!r}") from None
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise MalformedMessage(f"unexpected message kind {kind.name}")
        self._frames = frames
        try:
            return kind, decoder.decode(frames[1])
        except Exception as e:  # noqa: BLE001 (anything a hostile body makes msgspec raise)
            reason = f"malformed {kind.name} message: {type(e).__name__}: {e}"
            raise MalformedMessage(reason, kind, recover_id(kind, frames[1])) from None
        finally:
            self._frames = []


def StepEncoder() -> Encoder:  # noqa: N802 (a kind of Encoder)
    """An encoder of the step data (`STEP_TYPES`) between the engine core and a worker:
    numpy arrays as raw frames, never pickle; anything else is a TypeError."""
    return Encoder({t: k for k, t in STEP_TYPES.items()})


def StepDecoder() -> Decoder:  # noqa: N802 (a kind of Decoder)
    """The decoder of `StepEncoder`'s frames."""
    return Decoder(STEP_TYPES, STEP_TYPES, StepKind)


class MalformedMessage(ValueError):
    """A message that could not be decoded. `ident` is the request id (ADD) or call id
    (UTILITY) it carries, if that much could be read, so its sender can get an error."""

    def __init__(
        self, reason: str, kind: MsgKind | None = None, ident: str | int | None = None
    ) -> None:
        super().__init__(reason)
        self.kind = kind
        self.ident = ident


# The field naming what a message is for: whoever waits on it is told when it is malformed.
_ID_FIELDS: dict[MsgKind, tuple[str, type]] = {
    MsgKind.ADD: ("request_id", str),
    MsgKind.UTILITY: ("call_id", int),
}


def recover_id(kind: MsgKind, body: Any) -> str | int | None:
    """The id field of a body that did not decode as its struct: found by walking only
    the top level (a map, or an array for array_like structs), so a malformed or deeply
    nested value elsewhere does not hide it. None if it cannot be read."""
    if kind not in _ID_FIELDS:
        return None
    name, typ = _ID_FIELDS[kind]
    cls = MESSAGE_TYPES[kind]
    try:
        data = memoryview(body).cast("B")
        value: Any = None
        spans = _top_level_spans(data, want_map=not cls.__struct_config__.array_like)
        if cls.__struct_config__.array_like:
            index = cls.__struct_fields__.index(name)
            span = next(itertools.islice(spans, index, None), None)
            if span is not None:
                value = msgspec.msgpack.decode(data[span[0] : span[1]])
        else:
            for k in spans:
                v = next(spans)
                if msgspec.msgpack.decode(data[k[0] : k[1]]) == name:
                    value = msgspec.msgpack.decode(data[v[0] : v[1]])
                    break
    except Exception:  # noqa: BLE001 (not readable: no id)
        return None
    if type(value) is not typ:  # exactly: a bool is no call id
        return None
    return cast("str | int", value)


# msgpack type bytes past the fixed ranges: payload bytes that follow a fixed-size header;
# the width of a length field (bin, str, ext: bytes; ext adds its type byte); the width of
# a count field and items per count (arrays 1, maps 2: a key and a value).
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4}
_FIXED |= {0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17, 0xC0: 0, 0xC2: 0, 0xC3: 0}
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _header(data: memoryview, pos: int) -> tuple[int, int, int]:
    """Reads the header of the value at `pos`: (position after the header, payload bytes
    that follow it, items that follow the payload)."""
    b = data[pos]
    pos += 1
    if b <= 0x7F or b >= 0xE0:  # fixint
        return pos, 0, 0
    if b <= 0x8F:  # fixmap
        return pos, 0, 2 * (b & 0x0F)
    if b <= 0x9F:  # fixarray
        return pos, 0, b & 0x0F
    if b <= 0xBF:  # fixstr
        return pos, b & 0x1F, 0
    if b in _FIXED:
        return pos, _FIXED[b], 0
    width, per = _COUNTED.get(b, (_SIZED.get(b, 0), 0))
    if not width:
        raise ValueError(f"invalid msgpack byte 0x{b:02x}")
    if pos + width > len(data):
        raise ValueError("truncated")
    n = int.from_bytes(data[pos : pos + width], "big")
    pos += width
    if per:
        return pos, 0, n * per
    return pos, n + (1 if 0xC7 <= b <= 0xC9 else 0), 0


def _skip(data: memoryview, pos: int) -> int:
    """The end of the value at `pos`, without recursion (any depth)."""
    pending = 1
    while pending:
        pending -= 1
        pos, payload, items = _header(data, pos)
        pos += payload
        pending += items
        if pos > len(data):
            raise ValueError("truncated")
    return pos


def _top_level_spans(data: memoryview, want_map: bool) -> Iterator[tuple[int, int]]:
    """[start, end) of each element of a top-level array, or of each key and value of a
    top-level map (alternating), read lazily: what follows the one looked for may be
    broken."""
    b = data[0]
    is_map = 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)
    is_array = 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)
    if not (is_map if want_map else is_array):
        raise ValueError("not a " + ("map" if want_map else "array"))
    pos, _, items = _header(data, 0)
    for _ in range(items):
        end = _skip(data, pos)
        yield pos, end
        pos = end
