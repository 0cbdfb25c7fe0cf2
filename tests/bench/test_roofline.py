"""The workload roofline: the steps the scheduler makes of a workload (against an engine
core running it), each step's cost by hand, and the floors of the published workload."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncllm.bench import roofline
from asyncllm.bench.common import make_fixed_workload, make_workload
from asyncllm.bench.roofline import (
    ModelShape,
    PeakRates,
    card_rates,
    plan_floor,
    rates_from_args,
    step_cost,
)
from asyncllm.bench.workload_steps import plan_workload
from asyncllm.config import EngineArgs, SchedulerConfig
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_config import create_engine_config
from asyncllm.messages import EngineCoreRequest
from asyncllm.sampling_params import SamplingParams

from .test_workload import tiny_hf_configs

ROOT = Path(__file__).resolve().parents[2]

SHAPE = ModelShape(
    hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32,
    tie_word_embeddings=False,
)  # fmt: skip


def test_a_steps_cost_by_hand():
    # a decode over 10 keys and a 4-token prompt; both sample
    cost = step_cost(SHAPE, 2, [(1, 10), (4, 4)], sampled=2)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16 + 2 * 8  # q,k,v,o; the MLP; two norms
    assert SHAPE.token_parameters() == 2 * per_layer
    assert cost.gemm_flops == 2 * 5 * 2 * per_layer + 2 * 2 * 32 * 8  # (+ the LM head, 2 rows)
    # (query, key) pairs: 10, and 1 + 2 + 3 + 4; 2 * head_dim FLOPs for QK and PV per head
    assert cost.attention_flops == (10 + 10) * 2 * 2 * (2 * 2 * 4)
    # every key read once and the new ones written: 16 bytes per token and layer
    assert cost.kv_bytes == (11 + 8) * 2 * (2 * 1 * 4 * 2)
    assert cost.weight_bytes == (2 * per_layer + 8 + 32 * 8) * 2  # (embedding gathered)
    rates = PeakRates(bandwidth=1e3, flops=1e6)
    assert cost.seconds(rates) == pytest.approx(
        max(cost.gemm_flops / 1e6, cost.weight_bytes / 1e3)
        + max(cost.attention_flops / 1e6, cost.kv_bytes / 1e3)
    )
    # a step where nothing samples (prefill chunks only) reads no LM head
    chunk = step_cost(SHAPE, 2, [(4, 4)], sampled=0)
    assert chunk.weight_bytes == (2 * per_layer + 8) * 2
    with pytest.raises(ValueError, match="3 tokens with 2 keys"):
        step_cost(SHAPE, 2, [(3, 2)], 1)


def test_a_window_bounds_what_a_layer_reads():
    windowed = ModelShape(**{**SHAPE.__dict__, "sliding_window": 3, "sliding_layers": 1})
    full, cut = (step_cost(s, 2, [(1, 10)], 1) for s in (SHAPE, windowed))
    per_layer_pair = 2 * 2 * 4 * 2
    assert full.attention_flops == 2 * 10 * per_layer_pair
    assert cut.attention_flops == (10 + 3) * per_layer_pair
    assert cut.kv_bytes == (11 + 4) * 16
    # a prefill of 5 tokens at a window of 3 sees 1, 2, 3, 3, 3 keys
    assert step_cost(windowed, 2, [(5, 5)], 1).attention_flops == (15 + 12) * per_layer_pair
    gemma = ModelShape.from_hf_config(
        {
            **tiny_hf_configs()["qwen3"].to_dict(),
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        }
    )
    assert (gemma.sliding_window, gemma.sliding_layers) == (4, 1)


def test_moe_and_latent_steps():
    configs = tiny_hf_configs()
    moe = ModelShape.from_hf_config(configs["qwen3_moe"])
    dense_token = moe.parameter_counts()["layers"]
    assert moe.token_parameters() == dense_token - 6 * 3 * 64 * 24  # 2 of 8 experts
    mla = ModelShape.from_hf_config(configs["deepseek_v2"])
    decode = step_cost(mla, 2, [(1, 7)], 1)
    assert decode.attention_flops == 7 * 2 * mla.layers * mla.heads * (2 * 32 + 8)
    assert decode.kv_bytes == 8 * mla.kv_bytes_per_token(2)
    # a chunk of 2 after 5 keys of context up-projects those 5 (its own 2 are per token)
    up = mla.kv_lora_rank * mla.heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    prefill = step_cost(mla, 2, [(2, 7)], 1)
    assert (
        prefill.gemm_flops
        == 2 * 2 * mla.token_parameters() + 2 * 384 * 64 + 2 * 5 * mla.layers * up
    )


def _engine_core(folder: Path, **sched) -> EngineCore:
    """A 1-layer Qwen3 of random weights."""
    config = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b/config.json").read_text())
    config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=16)
    (folder / "config.json").write_text(json.dumps(config))
    args = EngineArgs(
        model=str(folder),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        **sched,
    )
    return EngineCore(create_engine_config(args))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_plan_is_the_engine_cores_schedule(tmp_path, async_scheduling):
    """The same requests queued at once in an engine core (a 1-layer model, random
    weights): the same number of steps, tokens and preemptions (a cache of 24 blocks
    preempts)."""
    prompts, max_tokens = make_workload(12, seed=3, max_input_len=90, max_output_len=40)
    sched = dict(
        max_model_len=256,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=24,
        async_scheduling=async_scheduling,
    )
    core = _engine_core(tmp_path, **sched)
    try:
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            params = SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0)
            core.add_request(EngineCoreRequest(f"{i}", p, params, None, m, time.monotonic()))
        while core.has_unfinished_requests() or core.has_pending_outputs():
            core.step()
        stats = core.scheduler.stats
        assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    finally:
        core.shutdown()
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=64,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    plan = plan_workload(prompts, max_tokens, config, num_blocks=24)
    assert stats.num_preemptions > 0 and plan.num_preemptions == stats.num_preemptions
    assert len(plan.steps) == stats.num_steps
    computed = sum(step.num_tokens for step in plan.steps)
    assert computed == stats.total_prefill_tokens + stats.total_decode_tokens
    # (with a step in flight, a request preempted meanwhile loses the token it sampled)
    sampled = sum(step.sampled for step in plan.steps)
    assert sampled >= sum(max_tokens) if async_scheduling else sampled == sum(max_tokens)


def test_a_shared_prefix_is_computed_once():
    prompts, max_tokens, _ = make_fixed_workload("shared-prefix", 6, prompt_len=64, output_len=2)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=512)
    # (the first request fills the cache; the five after it find the prefix's 4 blocks)
    cached = plan_workload(prompts, max_tokens, config, num_blocks=None)
    cold = plan_workload(prompts, max_tokens, config, enable_prefix_caching=False)
    assert cached.prefix_cache_hits == 5 * 64
    assert sum(s.num_tokens for s in cold.steps) == 6 * (64 + 64) + 6 * 1
    assert sum(s.num_tokens for s in cached.steps) == sum(s.num_tokens for s in cold.steps) - (
        cached.prefix_cache_hits
    )


def test_the_floors_of_nano_vllms_workload():
    """The published model of the workload (issue figures: an H100 at 90% of its HBM
    bandwidth and 790 TFLOP/s; about 1,032 steps; 13.9 TB of KV reads for the 0.6B
    shape): 10,200 and 12,900 output tok/s for the 8B shape, 25,700 and 26,800 for 0.6B."""
    prompts, max_tokens = make_workload()
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096)
    rates = card_rates("NVIDIA H100 80GB HBM3")
    assert rates is not None and rates.bandwidth == pytest.approx(3.015e12)
    plan = plan_workload(prompts, max_tokens, config)
    assert len(plan.steps) == 1032 and plan.num_preemptions == 0
    figures = {"qwen3-0.6b": (25_700, 26_800), "llama-3.1-8b": (10_200, 12_900)}
    for name, (serial, overlapped) in figures.items():
        cfg = json.loads((ROOT / "benchmarks/configs" / name / "config.json").read_text())
        shape = ModelShape.from_hf_config(cfg)
        costs = [step_cost(shape, 2, s.rows, s.sampled) for s in plan.steps]
        floor = roofline.workload_floor(costs, rates, sum(max_tokens))
        assert floor["serial_output_tok_s"] == pytest.approx(serial, rel=0.03)
        assert floor["overlapped_output_tok_s"] == pytest.approx(overlapped, rel=0.03)
        if name == "qwen3-0.6b":
            reads = floor["kv_bytes"] - sum(s.num_tokens for s in plan.steps) * 114_688
            assert reads == pytest.approx(13.9e12, rel=0.01)


def test_the_cards_rates():
    h200 = card_rates("NVIDIA H200")
    assert h200 == PeakRates(4.8e12 * 0.9, 989.4e12 * 0.8)
    assert card_rates("NVIDIA H100 PCIe") == PeakRates(2.0e12 * 0.9, 756e12 * 0.8)
    assert card_rates("Intel(R) Xeon(R)") is None
    given = SimpleNamespace(hbm_bandwidth=1e12, peak_flops=None)
    assert rates_from_args(given, "NVIDIA H200") == PeakRates(1e12, 989.4e12 * 0.8)
    assert rates_from_args(given, "cpu") is None
    with pytest.raises(ValueError, match="positive"):
        PeakRates(0.0, 1.0)


def test_the_command_line(capsys):
    model = ROOT / "benchmarks/configs/qwen3-0.6b"
    result = roofline.main(["--model", str(model), "--num-prompts", "8", "--card", "H200"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == result
    assert "floor: serial kernels, output tok/s" in out
    assert result["serial_s"] >= result["overlapped_s"] > 0
    prompts, max_tokens = make_workload(8)
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096)
    shape = ModelShape.from_hf_config(json.loads((model / "config.json").read_text()))
    same = plan_floor(shape, 2, prompts, max_tokens, config, card_rates("H200"), block_size=16)
    assert same["serial_s"] == pytest.approx(result["serial_s"])
    with pytest.raises(SystemExit):
        roofline.main(["--model", str(model), "--card", "B200"])


def test_kernels_by_class():
    from asyncllm.bench.kernel_classes import class_times, kernel_class

    named = {
        "nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNN": "gemm",
        "_skinny_gemm_kernel": "gemm",
        "_grouped_gemm_kernel": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "_paged_attention_kernel": "attention",
        "_merge_splits_kernel": "attention",
        "_mla_decode_kernel": "attention",
        "BatchDecodeWithPagedKVCacheKernel": "attention",
        "_rms_norm_kernel": "elementwise",
        "_silu_and_mul_kernel": "elementwise",
        "_rotary_kernel": "elementwise",
        "_reshape_and_cache_kernel": "elementwise",
        "_softmax_topk_kernel": "elementwise",  # (routing, not sampling)
        "void at::native::vectorized_elementwise_kernel<4, ...>": "elementwise",
        "void at::native::reduce_kernel<512, 1, ...ArgMaxOps...>": "sampling",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "sampling",
        "_apply_token_bitmask_kernel": "sampling",
        "some_new_kernel": "other",
    }
    assert {n: kernel_class(n) for n in named} == named
    times = class_times([("_rms_norm_kernel", 2.0), ("nvjet_x", 5.0), ("_rotary_kernel", 1.5)])
    assert times == {
        "gemm": 5.0,
        "attention": 0.0,
        "elementwise": 3.5,
        "sampling": 0.0,
        "other": 0.0,
    }


def test_class_floors_by_hand():
    from asyncllm.bench.kernel_classes import class_floors, elementwise_bytes_per_token

    rates = PeakRates(bandwidth=1e3, flops=1e6)
    floors = class_floors(SHAPE, 2, [(1, 10), (4, 4)], 2, rates)
    cost = step_cost(SHAPE, 2, [(1, 10), (4, 4)], 2)
    assert floors["gemm"] == max(cost.gemm_flops / 1e6, cost.weight_bytes / 1e3)
    assert floors["attention"] == max(cost.attention_flops / 1e6, cost.kv_bytes / 1e3)
    # per layer: two norms (4 x 8), SiLU-and-mul (3 x 16), rotary (2 x 12), K/V write (4 x 4)
    per_token = (2 * (2 * 4 * 8 + 3 * 16 + 2 * 12 + 4 * 4) + 2 * 8) * 2
    assert elementwise_bytes_per_token(SHAPE, 2) == per_token
    assert floors["elementwise"] == 5 * per_token / 1e3
    assert floors["sampling"] == 2 * 32 * 4 / 1e3 and floors["other"] == 0
