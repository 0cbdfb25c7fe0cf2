"""The memory-bandwidth floor of one decode step, from a Hugging Face config alone.

A batch-1 decode step reads every weight matrix once, except the input embedding table,
of which it gathers one row; the LM head is read in full (with tied embeddings it is the
embedding table, counted once). It also reads the KV cache of the whole context. Divided
by the memory bandwidth this gives the fastest a step can be, whatever the kernels do.

A mixture-of-experts layer (Qwen3-MoE, DeepSeek-V2) holds all its experts but a step
reads only the ones its tokens are routed to: at batch 1 the `num_experts_per_tok`
chosen ones, in a batch of B tokens the distinct experts they choose (`active_experts`:
under uniform routing, E * (1 - (1 - k/E)^B) on average), plus DeepSeek's shared experts,
which every token goes through.

A latent-attention model (MLA: DeepSeek-V2) caches one vector of `kv_lora_rank +
qk_rope_head_dim` values per token and layer instead of K and V, and its attention
weights are the low-rank projections (`q_a/q_b` or `q_proj`, `kv_a_proj_with_mqa`,
`kv_b_proj`, `o_proj`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from asyncllm.bench.workload_steps import plan_workload
from asyncllm.config import SchedulerConfig, num_experts
from asyncllm.messages import ResolvedConfig
from asyncllm.model.kv_groups import KVCacheLayout, kv_cache_layout, layer_sliding_window

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
H200_HBM_BYTES_PER_S = 4.3e12  # about 90% of the H200's 4.8 TB/s HBM3e peak


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2, or attention_bias
    o_bias: bool = False  # attention_bias (Llama, Qwen3)
    qk_norm: bool = False  # Qwen3: an RMSNorm weight of head_dim on q and on k
    mlp_bias: bool = False
    # mixture of experts (Qwen3-MoE): experts per sparse layer, chosen per token, their
    # width, and how many layers are sparse (the others keep the dense MLP)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0
    shared_intermediate: int = 0  # DeepSeek's shared experts, one MLP of their summed width
    # latent attention (MLA); kv_lora_rank 0: ordinary attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: a full-rank q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # sliding-window attention (Gemma 3, Mistral): the window, and how many layers use it
    sliding_window: int = 0
    sliding_layers: int = 0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a transformers config object or a config.json dict."""
        if isinstance(config, dict):
            config = SimpleNamespace(**config)
        get_text = getattr(config, "get_text_config", None)
        if callable(get_text):
            config = get_text()
        model_type = str(getattr(config, "model_type", "") or "")
        archs = getattr(config, "architectures", None) or [""]
        arch = str(archs[0])
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        is_qwen3 = model_type.startswith("qwen3") or arch.startswith("Qwen3")
        layers = int(config.num_hidden_layers)
        experts = num_experts(config)
        sparse = 0
        if experts:
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(config, "mlp_only_layers", None) or [])
            first = int(getattr(config, "first_k_dense_replace", 0) or 0)
            sparse = sum(
                1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first
            )
        moe_inter = int(getattr(config, "moe_intermediate_size", 0) or 0)
        shared = int(getattr(config, "n_shared_experts", 0) or 0) * moe_inter
        latent = int(getattr(config, "kv_lora_rank", 0) or 0)
        windows = [layer_sliding_window(config, i) for i in range(layers)]
        return cls(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or is_qwen2,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=is_qwen3,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            num_experts=experts,
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
            moe_intermediate=moe_inter,
            sparse_layers=sparse,
            shared_intermediate=shared,
            kv_lora_rank=latent,
            q_lora_rank=int(getattr(config, "q_lora_rank", 0) or 0) if latent else 0,
            qk_nope_head_dim=int(getattr(config, "qk_nope_head_dim", 0) or 0) if latent else 0,
            qk_rope_head_dim=int(getattr(config, "qk_rope_head_dim", 0) or 0) if latent else 0,
            v_head_dim=int(getattr(config, "v_head_dim", 0) or 0) if latent else 0,
            sliding_window=max((w or 0) for w in windows) if windows else 0,
            sliding_layers=sum(1 for w in windows if w),
        )

    def expert_parameters(self) -> int:
        """One expert's parameters (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_intermediate

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part; `total` is what the model holds (a tied LM head is the
        embedding table, so it is not counted twice). With experts, `per_layer` is a
        dense layer's and `experts` all sparse layers' experts and routers."""
        h, d = self.hidden, self.head_dim
        if self.kv_lora_rank:
            attn = self.latent_attention_parameters()
        else:
            q, kv = self.heads * d, self.kv_heads * d
            attn = h * (q + 2 * kv) + q * h
            if self.qkv_bias:
                attn += q + 2 * kv
            if self.o_bias:
                attn += h
            if self.qk_norm:
                attn += 2 * d
        mlp = 3 * h * self.intermediate
        if self.mlp_bias:
            mlp += 2 * self.intermediate + h
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embedding = self.vocab * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab * h
        router = self.num_experts * h
        shared = 3 * h * self.shared_intermediate
        experts = self.sparse_layers * (
            self.num_experts * self.expert_parameters() + router + shared
        )
        # (a sparse layer has no dense MLP)
        layers = self.layers * per_layer - self.sparse_layers * mlp + experts
        return {
            "embedding": embedding,
            "lm_head": lm_head,
            "per_layer": per_layer,
            "experts": experts,
            "layers": layers,
            "final_norm": h,
            "total": embedding + lm_head + layers + h,
        }

    def latent_attention_parameters(self) -> int:
        """One MLA layer's attention weights (biases aside)."""
        h, heads, r = self.hidden, self.heads, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        else:
            q = h * heads * qk
        kv = (
            h * (r + self.qk_rope_head_dim)
            + r
            + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return q + kv + heads * self.v_head_dim * h

    def active_experts(self, num_tokens: float) -> float:
        """Experts of one sparse layer a step of `num_tokens` tokens reads, on average
        under uniform routing (at one token, exactly `experts_per_token`)."""
        e, k = self.num_experts, self.experts_per_token
        if not e:
            return 0.0
        if num_tokens <= 1:
            return float(k)
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def streamed_parameters(self, num_tokens: float = 1) -> int:
        """Parameters a decode step of `num_tokens` tokens reads: all but the gathered
        embedding table (which with tied embeddings is read anyway, as the LM head) and
        the experts no token is routed to."""
        counts = self.parameter_counts()
        total = counts["total"]
        if not self.tie_word_embeddings:
            total -= counts["embedding"]
        idle = self.num_experts - self.active_experts(num_tokens)
        return int(total - self.sparse_layers * idle * self.expert_parameters())

    def token_parameters(self) -> int:
        """Weights of the decoder layers one token goes through (its experts only): twice
        this is a token's GEMM FLOPs, the LM head aside."""
        idle = self.num_experts - self.experts_per_token
        return (
            self.parameter_counts()["layers"] - self.sparse_layers * idle * self.expert_parameters()
        )

    def attention_flops_per_key(self, query_len: int) -> int:
        """FLOPs of one query attending to one key, over all layers (QK^T and PV). A
        latent-attention decode (one query) works in the latent space; its prefill on
        keys and values up-projected to the heads' sizes."""
        if self.kv_lora_rank:
            if query_len == 1:
                per_head = 2 * self.kv_lora_rank + self.qk_rope_head_dim
            else:
                per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        else:
            per_head = 2 * self.head_dim
        return 2 * self.layers * self.heads * per_head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.kv_lora_rank:  # (one latent vector per token and layer)
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


def decode_step_bytes(shape: ModelShape, dtype_bytes: int, context_len: float) -> dict[str, float]:
    """Bytes one batch-1 decode step reads: the streamed weights, and the KV cache of
    `context_len` tokens."""
    weights = shape.streamed_parameters() * dtype_bytes
    kv = context_len * shape.kv_bytes_per_token(dtype_bytes)
    return {"weights": float(weights), "kv": float(kv), "total": float(weights + kv)}


def decode_floor(
    shape: ModelShape,
    dtype_bytes: int,
    input_len: int,
    output_len: int,
    bandwidth: float = H200_HBM_BYTES_PER_S,
) -> dict[str, float]:
    """The bandwidth floor of batch-1 decoding `output_len` tokens after `input_len`,
    at the average context length input_len + output_len / 2."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    step = decode_step_bytes(shape, dtype_bytes, input_len + output_len / 2)
    seconds = step["total"] / bandwidth
    return {
        "weight_bytes": step["weights"],
        "kv_bytes": step["kv"],
        "bytes_per_step": step["total"],
        "bandwidth_bytes_per_s": float(bandwidth),
        "floor_ms_per_token": seconds * 1e3,
        "floor_tok_s": 1.0 / seconds,
    }


# --- whole workloads -------------------------------------------------------------------

# Datasheet peaks by card (SXM unless named): HBM bytes/s, dense bf16 tensor-core FLOP/s.
# The floors take BANDWIDTH_SHARE and GEMM_SHARE of them as what kernels can attain.
CARD_PEAKS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (2.0e12, 756e12),
    "H100 NVL": (3.9e12, 835e12),
    "H100": (3.35e12, 989.4e12),
    "H200": (4.8e12, 989.4e12),
}
BANDWIDTH_SHARE = 0.9
GEMM_SHARE = 0.8  # (790 TFLOP/s on an H100 SXM)


@dataclass(frozen=True)
class PeakRates:
    bandwidth: float  # bytes/s attainable
    flops: float  # FLOP/s attainable

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.flops > 0):
            raise ValueError(f"peak rates must be positive, got {self}")


def card_rates(device_name: str) -> PeakRates | None:
    """The attainable rates of a card by its name (torch.cuda.get_device_name), or None
    for a card the table does not know."""
    for card, (bandwidth, flops) in CARD_PEAKS.items():
        if card in device_name:
            return PeakRates(bandwidth * BANDWIDTH_SHARE, flops * GEMM_SHARE)
    return None


@dataclass(frozen=True)
class StepCost:
    """What one step must do at the least: GEMM FLOPs and the weights they read;
    attention FLOPs and the KV cache it reads (each request's keys once) and writes."""

    gemm_flops: float
    weight_bytes: float
    attention_flops: float
    kv_bytes: float

    def seconds(self, rates: PeakRates) -> float:
        """The GEMMs, then attention, each at the slower of its two rates."""
        f, b = rates.flops, rates.bandwidth
        return max(self.gemm_flops / f, self.weight_bytes / b) + max(
            self.attention_flops / f, self.kv_bytes / b
        )


def _visible_pairs(q: int, keys: int, window: int) -> float:
    """(query, key) pairs of `q` new queries, causally over `keys` keys in all, each
    query seeing at most `window` keys (0: no window)."""
    first = keys - q + 1  # keys the first new query sees without a window
    if not window:
        return q * first + q * (q - 1) / 2
    if first >= window:
        return q * window
    m = min(q, window - first)  # queries before the window is full
    return m * first + m * (m - 1) / 2 + (q - m) * window


def step_cost(
    shape: ModelShape, dtype_bytes: int, rows: Sequence[tuple[int, int]], sampled: int
) -> StepCost:
    """The cost of a step that computes, per request, `q` tokens attending causally to
    `keys` keys in all (its context included: `rows` of (q, keys)), and samples
    `sampled` rows (the LM head runs on those only). A sliding-window layer reads and
    attends to the keys in its window only."""
    tokens = sum(q for q, _ in rows)
    gemm = 2.0 * tokens * shape.token_parameters() + 2.0 * sampled * shape.vocab * shape.hidden
    window, windowed = shape.sliding_window, shape.sliding_layers
    full = shape.layers - windowed
    layer_kv = shape.kv_bytes_per_token(dtype_bytes) / shape.layers
    attention = kv_bytes = 0.0
    for q, keys in rows:
        if q < 1 or keys < q:
            raise ValueError(f"a step row computes {q} tokens with {keys} keys")
        per_layer = shape.attention_flops_per_key(q) / shape.layers
        attention += per_layer * full * _visible_pairs(q, keys, 0)
        # (every key read once, the new ones written)
        kv_bytes += layer_kv * full * (keys + q)
        if windowed:
            attention += per_layer * windowed * _visible_pairs(q, keys, window)
            kv_bytes += layer_kv * windowed * (min(keys, window + q - 1) + q)
        if shape.kv_lora_rank and q > 1:
            # (a chunk up-projects its context's keys and values; its new tokens' are in
            # token_parameters)
            per_key = shape.kv_lora_rank * shape.heads * (shape.qk_nope_head_dim + shape.v_head_dim)
            gemm += 2.0 * (keys - q) * shape.layers * per_key
    weights = shape.streamed_parameters(tokens) if tokens else 0
    if tokens and not sampled:  # (no row samples: the LM head is not read)
        weights -= shape.vocab * shape.hidden
    return StepCost(gemm, float(weights * dtype_bytes), attention, kv_bytes)


def workload_floor(
    costs: Sequence[StepCost], rates: PeakRates, output_tokens: int
) -> dict[str, float]:
    """The two floors of a workload's steps: `serial_s`, each step's GEMMs then its
    attention at their own floors with nothing in between; `overlapped_s`, all FLOPs
    at the peak while all bytes stream (memory- and compute-bound work overlapped
    perfectly, across steps too), with the output tok/s each allows."""
    flops = sum(c.gemm_flops + c.attention_flops for c in costs)
    traffic = sum(c.weight_bytes + c.kv_bytes for c in costs)
    serial = sum(c.seconds(rates) for c in costs)
    overlapped = max(flops / rates.flops, traffic / rates.bandwidth)
    return {
        "steps": len(costs),
        "gemm_flops": sum(c.gemm_flops for c in costs),
        "attention_flops": sum(c.attention_flops for c in costs),
        "weight_bytes": sum(c.weight_bytes for c in costs),
        "kv_bytes": sum(c.kv_bytes for c in costs),
        "bandwidth_bytes_per_s": rates.bandwidth,
        "flops_per_s": rates.flops,
        "serial_s": serial,
        "overlapped_s": overlapped,
        "serial_output_tok_s": output_tokens / serial if serial else math.inf,
        "overlapped_output_tok_s": output_tokens / overlapped if overlapped else math.inf,
    }


def rates_from_args(args: Any, device_name: str) -> PeakRates | None:
    """`--hbm-bandwidth` and `--peak-flops` where given, the card's rates for the rest;
    None where neither says (a CPU, a card the table lacks)."""
    card = card_rates(device_name)
    bandwidth = args.hbm_bandwidth or (card.bandwidth if card else None)
    flops = args.peak_flops or (card.flops if card else None)
    if bandwidth is None or flops is None:
        return None
    return PeakRates(bandwidth, flops)


def plan_floor(
    shape: ModelShape,
    dtype_bytes: int,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    config: SchedulerConfig,
    rates: PeakRates | None,
    *,
    block_size: int,
    num_blocks: int | None = None,
    layout: KVCacheLayout | None = None,
    enable_prefix_caching: bool = True,
) -> dict[str, Any]:
    """The workload's steps as the scheduler forms them (`workload_steps`), and with
    `rates` its floors (`workload_floor`)."""
    plan = plan_workload(
        prompts,
        max_tokens,
        config,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
        layout=layout,
        vocab_size=shape.vocab,
    )
    out: dict[str, Any] = {
        "steps": len(plan.steps),
        "preemptions": plan.num_preemptions,
        "prefix_cache_hit_tokens": plan.prefix_cache_hits,
        "num_blocks": plan.num_blocks,
        "batched_tokens": sum(step.num_tokens for step in plan.steps),
    }
    if rates is not None:
        costs = [step_cost(shape, dtype_bytes, s.rows, s.sampled) for s in plan.steps]
        out.update(workload_floor(costs, rates, sum(max_tokens)))
    return out


def engine_workload_floor(
    config: ResolvedConfig,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    num_blocks: int,
    rates: PeakRates | None,
    hybrid: bool = True,
) -> dict[str, Any]:
    """`plan_floor` for an engine as it runs (its model, dtype, scheduler settings and
    KV blocks), over the requests of one `generate` queued at once."""
    hf_config = SimpleNamespace(**config.hf_config)
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        async_scheduling=config.async_scheduling,
    )
    return plan_floor(
        ModelShape.from_hf_config(config.hf_config),
        DTYPE_BYTES[config.dtype],
        prompts,
        max_tokens,
        sched,
        rates,
        block_size=config.block_size,
        num_blocks=num_blocks,
        layout=kv_cache_layout(hf_config, hybrid),
    )


def parse_args(argv: list[str] | None) -> Any:
    import argparse

    from asyncllm.bench.common import (
        add_peak_rate_args,
        add_throughput_workload_args,
        check_throughput_workload_args,
    )

    parser = argparse.ArgumentParser(
        prog="python -m asyncllm.bench.roofline",
        description="The floors of a throughput workload on a card, from a model's config "
        "and the engine's scheduler settings (no model runs).",
    )
    parser.add_argument("--model", required=True, help="a model folder with its config.json")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--card", default="H100", help=f"one of {', '.join(CARD_PEAKS)}")
    g = parser.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=16384)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: no preemption)"
    )
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    add_throughput_workload_args(parser)
    add_peak_rate_args(parser)
    args = parser.parse_args(argv)
    check_throughput_workload_args(parser, args)
    if args.card not in CARD_PEAKS:
        parser.error(f"--card {args.card!r}: one of {', '.join(CARD_PEAKS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from transformers import AutoConfig

    from asyncllm.bench.common import format_table, report, throughput_workload

    args = parse_args(argv)
    prompts, max_tokens, _ = throughput_workload(args)
    hf_config = AutoConfig.from_pretrained(args.model)
    shape = ModelShape.from_hf_config(hf_config)
    rates = rates_from_args(args, args.card)
    assert rates is not None  # (the card is in the table)
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        async_scheduling=args.async_scheduling,
    )
    floor = plan_floor(
        shape,
        DTYPE_BYTES[args.dtype],
        prompts,
        max_tokens,
        sched,
        rates,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        layout=kv_cache_layout(getattr(hf_config, "get_text_config", lambda: hf_config)()),
        enable_prefix_caching=args.prefix_caching,
    )
    table = format_table(
        ["figure", "value"],
        [
            ["steps", floor["steps"]],
            ["batched tokens", floor["batched_tokens"]],
            ["preemptions", floor["preemptions"]],
            ["prefix-cache hits, tokens", floor["prefix_cache_hit_tokens"]],
            ["GEMM TFLOP", floor["gemm_flops"] / 1e12],
            ["attention TFLOP", floor["attention_flops"] / 1e12],
            ["weights read, GB", floor["weight_bytes"] / 1e9],
            ["KV read and written, GB", floor["kv_bytes"] / 1e9],
            ["floor: serial kernels, s", floor["serial_s"]],
            ["floor: serial kernels, output tok/s", floor["serial_output_tok_s"]],
            ["floor: all overlapped, s", floor["overlapped_s"]],
            ["floor: all overlapped, output tok/s", floor["overlapped_output_tok_s"]],
        ],
    )
    title = (
        f"roofline: {args.model}, {args.dtype}, {args.workload} workload on an {args.card} "
        f"({rates.bandwidth / 1e12:.3g} TB/s, {rates.flops / 1e12:.4g} TFLOP/s attainable)"
    )
    return report(title, table, {"benchmark": "roofline", "model": args.model, **floor})


if __name__ == "__main__":
    main()
