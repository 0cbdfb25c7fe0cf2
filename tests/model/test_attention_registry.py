"""The attention backend registry: a backend is one module and one entry; the engine
runs the one named, or the first that fits ("auto"), and refuses one that cannot run."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from asyncllm.messages import EngineCoreRequest
from asyncllm.model.attention.registry import (
    AttentionBackendEntry,
    AttentionCGSupport,
    AttentionFeature,
    AttentionNeeds,
    KVCacheLayout,
    attention_backend_names,
    find_attention_backend,
    library_installed,
    register_attention_backend,
    select_attention_backend,
    unregister_attention_backend,
)
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.model_runner import ModelRunner
from tests.model.tiny import make_tiny_model, tiny_engine_core

CPU = torch.device("cpu")


class CountingBackend(TorchNativeBackend):
    """The torch backend, counting its layer calls (class-wide: the engine makes its own)."""

    name = "counting"
    calls = 0

    def forward(self, spec, q, k, v, kv_cache, metadata):  # type: ignore[no-untyped-def]
        CountingBackend.calls += 1
        return super().forward(spec, q, k, v, kv_cache, metadata)


def _entry(name: str, **fields) -> AttentionBackendEntry:
    base = dict(
        name=name,
        class_path=f"{__name__}:CountingBackend",
        device_types=frozenset({"cpu"}),
        features=frozenset({AttentionFeature.SLIDING_WINDOW, AttentionFeature.LOGITS_SOFT_CAP}),
        cudagraph_support=AttentionCGSupport.NEVER,
    )
    base.update(fields)
    return AttentionBackendEntry(**base)  # type: ignore[arg-type]


@pytest.fixture
def counting() -> Iterator[AttentionBackendEntry]:
    entry = _entry("counting")
    register_attention_backend(entry)
    try:
        yield entry
    finally:
        unregister_attention_backend("counting")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-registry")
    make_tiny_model("llama3", folder)
    return folder


@pytest.mark.parametrize(
    "name,library,extra",
    [
        ("flashinfer", "flashinfer", "flashinfer"),
        ("flashinfer_prefill", "flashinfer", "flashinfer"),
        ("flash_attn", "flash_attn.cute", "flash-attn"),
    ],
)
def test_a_named_backend_whose_library_is_missing_fails_saying_how_to_install_it(
    name, library, extra
):
    if library_installed(library):
        pytest.skip(f"{library} is installed here: nothing is missing")
    needs = AttentionNeeds(torch.device("cuda"), torch.bfloat16, 128, 16)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"attention_backend '{name}' needs {library}, "
            f"which is not installed (pip install 'asyncllm[{extra}]')"
        ),
    ):
        find_attention_backend(name, needs)
    assert find_attention_backend("auto", needs).name == "triton"


def test_the_built_in_backends_come_first_and_triton_stays_unimported():
    names = attention_backend_names()
    assert names[:7] == [
        "triton", "triton_mla", "flashinfer", "flashinfer_prefill", "flash_attn",
        "torch_native", "torch_mla",
    ]  # fmt: skip
    triton = find_attention_backend("triton", AttentionNeeds(torch.device("cuda")))
    assert triton.cudagraph_support is AttentionCGSupport.UNIFORM_BATCH
    assert triton.kv_cache_layout is KVCacheLayout.KV_BLOCKS_TOKENS_HEADS
    # Choosing a backend on the CPU imports neither Triton nor the Triton backend.
    code = (
        "import sys, torch\n"
        "from asyncllm.model.attention.registry import select_attention_backend\n"
        "select_attention_backend(torch.device('cpu'))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert 'asyncllm.model.attention.triton_attn' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_registered_backend_is_chosen_by_name_and_runs_engine_steps(tiny_folder, counting):
    core = tiny_engine_core(tiny_folder, attention_backend="counting")
    try:
        runner = core.executor.worker.runner  # type: ignore[attr-defined]
        assert isinstance(runner, ModelRunner)
        assert type(runner.backend) is CountingBackend and runner.attention is counting
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [1, 2, 3, 4], params, None, 3, time.monotonic()))
        before, tokens = CountingBackend.calls, []
        for _ in range(20):
            if not core.has_unfinished_requests():
                break
            tokens += [t for o in core.step().outputs for t in o.new_token_ids]
        assert len(tokens) == 3
        assert CountingBackend.calls > before
    finally:
        core.shutdown()


class SharedPlanBackend(TorchNativeBackend):
    """As a backend whose step plan is one shared object (FlashInfer's wrappers)."""

    name = "shared_plan"
    streams_safe = False


def test_micro_batches_are_refused_where_the_backend_shares_its_plan(tiny_folder):
    register_attention_backend(_entry("shared_plan", class_path=f"{__name__}:SharedPlanBackend"))
    try:
        with pytest.raises(ValueError, match=r"ubatch=2 needs an attention backend .* shared_plan"):
            tiny_engine_core(tiny_folder, attention_backend="shared_plan", ubatch=2)
        core = tiny_engine_core(tiny_folder, attention_backend="shared_plan")  # (off: fine)
        core.shutdown()
    finally:
        unregister_attention_backend("shared_plan")


def test_auto_logs_its_choice(caplog):
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        backend = select_attention_backend(CPU, "auto")
    assert isinstance(backend, TorchNativeBackend)
    assert any(
        r.name.startswith("asyncllm.")
        and "torch_native" in r.getMessage()
        and "auto" in r.getMessage()
        for r in caplog.records
    )


def test_auto_skips_a_backend_without_a_feature_the_model_needs(counting):
    lean = _entry("lean", features=frozenset())
    register_attention_backend(lean)
    try:
        # (registered after the built-ins: "auto" reaches them first)
        needs = AttentionNeeds(CPU, torch.float32, 64, 16, frozenset())
        assert find_attention_backend(None, needs).name == "torch_native"
        windowed = AttentionNeeds(CPU, features=frozenset({AttentionFeature.SLIDING_WINDOW}))
        with pytest.raises(ValueError, match="attention_backend 'lean' does not support sliding"):
            find_attention_backend("lean", windowed)
    finally:
        unregister_attention_backend("lean")


def test_latent_attention_takes_an_mla_backend_and_only_it():
    latent = frozenset({AttentionFeature.LATENT_ATTENTION})
    assert find_attention_backend("auto", AttentionNeeds(CPU, features=latent)).name == "torch_mla"
    cuda = AttentionNeeds(torch.device("cuda"), torch.bfloat16, 576, 16, latent)
    mla = find_attention_backend("auto", cuda)
    assert mla.name == "triton_mla" and mla.kv_cache_layout is KVCacheLayout.LATENT_BLOCKS_TOKENS
    assert mla.cudagraph_support is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    with pytest.raises(ValueError, match="'triton' does not support latent attention"):
        find_attention_backend("triton", cuda)
    # An MLA backend serves nothing else, so "auto" never picks one for a plain model.
    with pytest.raises(ValueError, match="'torch_mla' serves only latent-attention"):
        find_attention_backend("torch_mla", AttentionNeeds(CPU))
    assert find_attention_backend("auto", AttentionNeeds(CPU)).name == "torch_native"


def test_an_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend must be one of .*'flash'"):
        select_attention_backend(CPU, "flash")


def test_a_backend_that_does_not_run_on_the_device_is_refused(tiny_folder):
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device, got cpu"):
        select_attention_backend(CPU, "triton")
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        tiny_engine_core(tiny_folder, attention_backend="triton")


def test_a_backend_refuses_a_dtype_or_block_size_it_does_not_declare(counting):
    picky = _entry("picky", dtypes=frozenset({torch.bfloat16}), block_sizes=frozenset({32}))
    register_attention_backend(picky)
    try:
        with pytest.raises(ValueError, match="'picky' does not support dtype torch.float32"):
            find_attention_backend("picky", AttentionNeeds(CPU, torch.float32))
        with pytest.raises(ValueError, match="'picky' does not support block size 16"):
            find_attention_backend("picky", AttentionNeeds(CPU, torch.bfloat16, block_size=16))
        with pytest.raises(ValueError, match="registered already"):
            register_attention_backend(picky)
    finally:
        unregister_attention_backend("picky")


def test_a_backend_whose_layout_differs_from_its_declaration_is_refused():
    class Flat(TorchNativeBackend):
        @staticmethod
        def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):  # type: ignore[no-untyped-def]
            return (num_blocks, 2, block_size, num_kv_heads, head_size)

    globals()["Flat"] = Flat
    try:
        entry = _entry("flat", class_path=f"{__name__}:Flat")
        with pytest.raises(TypeError, match="declared layout"):
            entry.load()
    finally:
        del globals()["Flat"]
