"""EngineArgs rejects bad values with errors that name the field."""

from __future__ import annotations

import pytest
import torch

from asyncllm import EngineArgs
from asyncllm.config import resolve_device, resolve_dtype


@pytest.mark.parametrize(
    "kwargs,error,field",
    [
        ({"model": 42}, TypeError, "model"),
        ({"model": "  "}, ValueError, "model"),
        ({"dtype": "float8"}, ValueError, "dtype"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 24}, ValueError, "block_size"),
        ({"max_model_len": 0}, ValueError, "max_model_len"),
        ({"max_model_len": "long"}, ValueError, "max_model_len"),
        ({"load_format": "onnx"}, ValueError, "load_format"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"device": 3}, TypeError, "device"),
        ({"tokenizer": 7}, TypeError, "tokenizer"),
    ],
)
def test_bad_values_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        EngineArgs(**kwargs)


def test_auto_dtype_follows_the_device():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("half", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(torch.int8, torch.device("cpu"))


def test_device_validation():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'banana'"):
        resolve_device("banana")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_max_model_len_beyond_the_model_is_rejected(smollm_config):
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        EngineArgs(max_model_len=100_000, device="cpu").create_model_config()
    assert EngineArgs(max_model_len=512, device="cpu").create_model_config().max_model_len == 512
