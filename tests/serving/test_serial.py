"""The wire format: msgpack round trips, raw array frames, and refusal of anything else."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from asyncllm import SamplingParams
from asyncllm.engine.serial import Decoder, Encoder
from asyncllm.messages import (
    FROM_CORE,
    MESSAGE_TYPES,
    TO_CORE,
    AbortRequests,
    DeadKind,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    EngineStartup,
    ErrorKind,
    MsgKind,
    RequestError,
    ResolvedConfig,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from asyncllm.step_io import TokenLogprobs

EXAMPLES = [
    EngineStartup(engine_args={"model": None, "dtype": "float32", "seed": 3, "x": [], "g": 0.5}),
    EngineCoreRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(temperature=0.5, stop=["x"], logit_bias={5: -1.0}),
        2,
        16,
        12.5,
        priority=3,
    ),
    AbortRequests(["a", "b"]),
    UtilityCall(7, "get_stats"),
    EngineReady(num_blocks=10, startup_seconds={"core: load weights": 0.5}),
    ResolvedConfig(
        model=None,
        model_path="/cache/models/m",
        tokenizer="/cache/models/m",
        architecture="LlamaForCausalLM",
        load_format="auto",
        max_model_len=64,
        vocab_size=100,
        eos_token_id=2,
        max_logprobs=20,
        dtype="float32",
        device="cpu",
        async_scheduling=True,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        attention_backend=None,
        enforce_eager=False,
        hf_config={"hidden_size": 64, "rope_parameters": {"rope_theta": 1e4}, "layer_types": None},
    ),
    EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "a",
                [7, 8],
                TokenLogprobs([[7, 1]], [[-0.1, -2.0]], [1]),
                finish_reason="stop",
                stop_reason=8,
            ),
            EngineCoreOutput(
                "b", [], finish_reason="abort", error=RequestError(ErrorKind.OVERLOADED, "full")
            ),
        ],
        scheduler_stats=SchedulerStats(num_running=2),
    ),
    UtilityResult(7, {"num_running": 1}),
    EngineDead(DeadKind.CRASHED, "boom"),
]


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_keeps_every_field(msg):
    side = TO_CORE if type(msg) in [MESSAGE_TYPES[k] for k in TO_CORE] else FROM_CORE
    kind, got = Decoder(side).decode(Encoder().encode(msg))
    assert MESSAGE_TYPES[kind] is type(msg) and got == msg


def test_error_kind_survives_the_wire():
    out = next(m for m in EXAMPLES if isinstance(m, EngineCoreOutputs))
    _, got = Decoder(FROM_CORE).decode(Encoder().encode(out))
    assert got.outputs[1].error.kind is ErrorKind.OVERLOADED


def test_numpy_arrays_travel_as_raw_frames():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = Encoder().encode(UtilityResult(1, {"x": arr}))
    assert len(frames) == 3 and bytes(frames[2]) == arr.tobytes()
    _, got = Decoder(FROM_CORE).decode(frames)
    assert np.array_equal(got.result["x"], arr) and got.result["x"].dtype == np.float32


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
        Decoder(TO_CORE).decode(frames)


@pytest.mark.parametrize(
    "obj", [{"request_id": "x"}, ["a"], "text", 3, None, TokenLogprobs([], [], [])]
)
def test_only_message_structs_are_sent(obj):
    with pytest.raises(TypeError, match="only asyncllm.messages structs"):
        Encoder().encode(obj)


def test_objects_without_a_wire_form_are_refused():
    with pytest.raises(TypeError, match="cannot send"):
        Encoder().encode(UtilityResult(1, {"f": object()}))


def test_each_kind_decodes_on_one_side_only():
    assert set(TO_CORE) | set(FROM_CORE) == set(MsgKind)
    assert not set(TO_CORE) & set(FROM_CORE)
