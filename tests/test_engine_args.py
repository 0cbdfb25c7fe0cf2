"""EngineArgs rejects bad values with errors that name the field."""

from __future__ import annotations

import pytest
import torch

from asyncllm import EngineArgs
from asyncllm.engine.core_config import (
    create_engine_config,
    create_model_config,
    resolve_device,
    resolve_dtype,
)


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
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, ValueError, "scheduling_policy"),
        ({"gpu_memory_utilization": 1.5}, ValueError, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size"),
        ({"pipeline_parallel_size": 0}, ValueError, "pipeline_parallel_size"),
        ({"distributed_executor_backend": "dask"}, ValueError, "distributed_executor_backend"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            ValueError,
            "distributed_executor_backend",
        ),
        ({"logits_processors": "mod:Cls"}, TypeError, "logits_processors"),
        ({"enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching"),
        ({"enable_chunked_prefill": 1}, TypeError, "enable_chunked_prefill"),
        ({"enforce_eager": None}, TypeError, "enforce_eager"),
        ({"skip_tokenizer_init": "no"}, TypeError, "skip_tokenizer_init"),
        ({"kv_cache_memory_bytes": -1}, ValueError, "kv_cache_memory_bytes"),
        ({"num_gpu_blocks_override": 0}, ValueError, "num_gpu_blocks_override"),
        ({"long_prefill_token_threshold": -1}, ValueError, "long_prefill_token_threshold"),
        ({"max_logprobs": -1}, ValueError, "max_logprobs"),
        ({"attention_backend": ""}, ValueError, "attention_backend"),
        ({"attention_backend": 3}, ValueError, "attention_backend"),
        ({"speculative_config": [4]}, TypeError, "speculative_config"),
        ({"speculative_config": "{4"}, ValueError, "speculative_config"),
        ({"speculative_config": {"method": "eagle"}}, ValueError, "method"),
        ({"speculative_config": {"method": "ngram"}}, ValueError, "num_speculative_tokens"),
        ({"speculative_config": {"num_speculative_tokens": 0}}, ValueError, "num_speculative"),
        ({"speculative_config": {"num_speculative_tokens": "3"}}, TypeError, "num_speculative"),
        (
            {
                "speculative_config": {
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 4,
                    "prompt_lookup_max": 2,
                }
            },
            ValueError,
            "prompt_lookup_min",
        ),
        ({"speculative_config": {"num_speculative_tokens": 3, "model": "x"}}, ValueError, "model"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128},
            ValueError,
            "max_num_batched_tokens",
        ),
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
        create_model_config(EngineArgs(max_model_len=100_000, device="cpu"))
    assert create_model_config(EngineArgs(max_model_len=512, device="cpu")).max_model_len == 512


def test_triton_attention_needs_cuda(smollm_config):
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        create_engine_config(EngineArgs(device="cpu", attention_backend="triton"))


def test_an_unregistered_attention_backend_is_refused_at_start_up(smollm_config):
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', .*'flash'"):
        create_engine_config(EngineArgs(device="cpu", attention_backend="flash"))


def test_grammar_threads_default_to_half_the_usable_cpus_up_to_4_and_refuse_junk(monkeypatch):
    import os

    from asyncllm import envs

    monkeypatch.delenv("ASYNCLLM_GRAMMAR_THREADS", raising=False)
    for cpus, threads in ((1, 1), (2, 1), (4, 2), (6, 3), (16, 4), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert envs.grammar_threads() == threads
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_THREADS", "3")
    assert envs.grammar_threads() == 3
    for junk in ("0", "-1", "two", ""):
        monkeypatch.setenv("ASYNCLLM_GRAMMAR_THREADS", junk)
        with pytest.raises(ValueError, match="ASYNCLLM_GRAMMAR_THREADS"):
            envs.grammar_threads()


def test_flashinfer_sampling_is_asked_for(monkeypatch):
    """Off unless ASYNCLLM_FLASHINFER_SAMPLING=1 (its kernel compiles for minutes on first
    use), and never without FlashInfer installed."""
    import importlib.util

    from asyncllm import envs

    monkeypatch.delenv("ASYNCLLM_FLASHINFER_SAMPLING", raising=False)
    assert envs.flashinfer_sampling_enabled() is False
    monkeypatch.setenv("ASYNCLLM_FLASHINFER_SAMPLING", "1")
    installed = importlib.util.find_spec("flashinfer") is not None
    assert envs.flashinfer_sampling_enabled() is installed


def test_the_fused_kv_write_can_be_turned_off_for_measuring(monkeypatch):
    """ASYNCLLM_FUSED_KV_WRITE=0: the Triton backends name no slots for the rotary launch
    (their own launch writes the cache); junk is refused."""
    import torch

    from asyncllm.model.attention.triton_attn import TritonAttentionBackend

    class Md:
        slot_mapping = torch.arange(3)

    monkeypatch.delenv("ASYNCLLM_FUSED_KV_WRITE", raising=False)
    assert TritonAttentionBackend().fused_kv_slots(Md()) is Md.slot_mapping
    monkeypatch.setenv("ASYNCLLM_FUSED_KV_WRITE", "0")
    assert TritonAttentionBackend().fused_kv_slots(Md()) is None
    monkeypatch.setenv("ASYNCLLM_FUSED_KV_WRITE", "no")
    with pytest.raises(ValueError, match="ASYNCLLM_FUSED_KV_WRITE"):
        TritonAttentionBackend()


def test_the_fused_gemm_neighbours_are_asked_for_by_their_variable(monkeypatch):
    """ASYNCLLM_FUSED_GEMM=1: linear layers built then take in their neighbours' launches
    (off by default); junk is refused, naming the variable."""
    from asyncllm.model.layers.linear import RowParallelLinear

    monkeypatch.delenv("ASYNCLLM_FUSED_GEMM", raising=False)
    assert RowParallelLinear(8, 4).fuse_neighbours is False
    monkeypatch.setenv("ASYNCLLM_FUSED_GEMM", "1")
    assert RowParallelLinear(8, 4).fuse_neighbours is True
    monkeypatch.setenv("ASYNCLLM_FUSED_GEMM", "yes")
    with pytest.raises(ValueError, match="ASYNCLLM_FUSED_GEMM"):
        RowParallelLinear(8, 4)


def test_pdl_is_asked_for_by_its_variable_and_never_reaches_the_cpu(monkeypatch):
    """ASYNCLLM_PDL (default off; junk refused); even turned on, a kernel whose inputs
    live on the CPU (Triton's interpreter) is launched without it."""
    import torch

    from asyncllm import envs
    from asyncllm_kernels import pdl

    monkeypatch.delenv("ASYNCLLM_PDL", raising=False)
    assert envs.pdl_launch() is False
    monkeypatch.setenv("ASYNCLLM_PDL", "1")
    assert envs.pdl_launch() is True
    monkeypatch.setenv("ASYNCLLM_PDL", "yes")
    with pytest.raises(ValueError, match="ASYNCLLM_PDL"):
        envs.pdl_launch()
    monkeypatch.setattr(pdl, "_enabled", True)
    assert pdl.options(torch.zeros(1)) == {"PDL": False}


def test_speculative_config_is_completed_as_vllm_completes_it() -> None:
    def spec(**kw):
        return EngineArgs(speculative_config=kw).speculative_config

    assert spec(num_speculative_tokens=3) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5, "disable_by_batch_size": 8,
    }  # fmt: skip
    assert spec(num_speculative_tokens=2, prompt_lookup_max=4)["prompt_lookup_min"] == 4
    assert spec(num_speculative_tokens=2, prompt_lookup_min=2)["prompt_lookup_max"] == 2
    assert spec(method="ngram_gpu", num_speculative_tokens=2)["method"] == "ngram"
    from_cli = EngineArgs(speculative_config='{"num_speculative_tokens": 4}').speculative_config
    assert from_cli is not None and from_cli["num_speculative_tokens"] == 4


def test_speculation_is_refused_where_it_cannot_run_yet(smollm_config) -> None:
    spec = {"num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        create_engine_config(
            EngineArgs(device="cpu", speculative_config=spec, pipeline_parallel_size=2)
        )
    config = create_engine_config(EngineArgs(device="cpu", speculative_config=spec))
    assert config.scheduler.speculative is not None
    assert config.scheduler.speculative.num_speculative_tokens == 2
