"""The wire format: msgpack round trips, raw array frames, and refusal of anything else."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from asyncllm import SamplingParams
from asyncllm.core.outputs import EngineCoreOutput, EngineCoreOutputs
from asyncllm.engine.core_proc import INPUT_TYPES
from asyncllm.engine.messages import EngineCoreRequest
from asyncllm.engine.serial import Decoder, Encoder, MsgKind
from asyncllm.step_io import TokenLogprobs


def test_request_round_trip_keeps_every_field():
    req = EngineCoreRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(temperature=0.5, stop=["x"], logit_bias={5: -1.0}),
        2,
        16,
        12.5,
        priority=3,
    )
    kind, got = Decoder(INPUT_TYPES).decode(Encoder().encode(MsgKind.ADD, req))
    assert kind is MsgKind.ADD and got == req


def test_outputs_round_trip():
    out = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "a",
                [7, 8],
                TokenLogprobs([[7, 1]], [[-0.1, -2.0]], [1]),
                finish_reason="stop",
                stop_reason=8,
            )
        ]
    )
    frames = Encoder().encode(MsgKind.OUTPUTS, out)
    kind, got = Decoder({MsgKind.OUTPUTS: EngineCoreOutputs}).decode(frames)
    assert got == out


def test_numpy_arrays_travel_as_raw_frames():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = Encoder().encode(MsgKind.UTILITY, {"x": arr})
    assert len(frames) == 3 and bytes(frames[2]) == arr.tobytes()
    _, got = Decoder({MsgKind.UTILITY: dict}).decode(frames)
    assert np.array_equal(got["x"], arr) and got["x"].dtype == np.float32


@pytest.mark.parametrize(
    "frames,match",
    [
        ([b"A"], "two frames"),
        ([b"?", b"\x90"], "unknown message kind"),
        ([b"A", pickle.dumps({"request_id": "x"})], "malformed ADD"),
        ([pickle.dumps(("ADD", 1)), b""], "unknown message kind"),
        ([b"A", b"\x93\xa1x\x90\x01"], "malformed ADD"),
        ([b"O", b"\x90"], "unexpected message kind"),
    ],
)
def test_anything_else_is_rejected_with_a_reason(frames, match):
    with pytest.raises(ValueError, match=match):
        Decoder(INPUT_TYPES).decode(frames)


def test_objects_without_a_wire_form_are_refused():
    with pytest.raises(TypeError, match="cannot send"):
        Encoder().encode(MsgKind.UTILITY, {"f": object()})
