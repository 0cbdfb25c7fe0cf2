"""A step's device time by kernel class, beside each class's own floor.

Kernels are classed by name (cuBLAS, Triton and torch kernels as a trace names them):
GEMMs, attention, elementwise work (norms, activations, rotary, cache writes), sampling,
and the rest. Each class's floor for the step is the slower of its FLOPs at the GEMM
rate and its bytes at the memory bandwidth (`asyncllm.bench.roofline.step_cost` for
GEMMs and attention; for elementwise work, each token's activations read and written
once per kernel of the plain path; for sampling, the sampled rows' logits read once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from asyncllm.bench.roofline import ModelShape, PeakRates, step_cost

KERNEL_CLASSES = ("gemm", "attention", "elementwise", "sampling", "other")

# (class, name fragments), first match wins: attention before GEMM (an attention kernel
# may name its MMA), sampling's reductions before the elementwise catch-alls.
_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("elementwise", ("softmax_topk", "align_small")),  # (a mixture of experts' routing)
    (
        "attention",
        (
            "paged_attention",
            "merge_splits",
            "mla_decode",
            "batchdecode",
            "batchprefill",
            "prefillwithkvcache",
            "flash_fwd",
            "fmha",
            "attention",
        ),
    ),
    (
        "gemm",
        ("nvjet", "gemm", "xmma", "cutlass", "cublas", "_matmul", "splitkreduce"),
    ),
    (
        "sampling",
        (
            "softmax",
            "argmax",
            "topk",
            "top_k",
            "sort",
            "multinomial",
            "exponential",
            "bitmask",
            "reduce_kernel",
            "distribution",
            "cumsum",
            "radix",
        ),
    ),
    (
        "elementwise",
        (
            "rms_norm",
            "silu",
            "rotary",
            "reshape_and_cache",
            "concat_and_cache",
            "elementwise",
            "catarraybatchedcopy",
            "index",
            "gather",
            "scatter",
            "copy",
            "fill",
        ),
    ),
)


def kernel_class(name: str) -> str:
    """The class of a kernel by its name."""
    low = name.lower()
    for cls, fragments in _PATTERNS:
        if any(f in low for f in fragments):
            return cls
    return "other"


def class_times(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Summed durations by class of (name, duration) pairs; every class present."""
    out = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for name, dur in kernels:
        out[kernel_class(name)] += dur
    return out


def elementwise_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Activation bytes one token's elementwise kernels read and write: per layer two
    RMSNorms with the residual add (x and the residual in, both out), SiLU-and-mul (the
    gate and up halves in, one out), rotary on q and k (in and out; Qwen3's q/k norms
    the same again) and the K/V cache write (in and out); the final norm."""
    h, d = shape.hidden, shape.head_dim
    qk = (shape.heads + shape.kv_heads) * d
    inter = shape.moe_intermediate * shape.experts_per_token if shape.num_experts else 0
    inter = inter or shape.intermediate
    per_layer = 2 * 4 * h + 3 * inter + 2 * qk + 4 * shape.kv_heads * d
    if shape.qk_norm:
        per_layer += 2 * qk
    return (shape.layers * per_layer + 2 * h) * dtype_bytes


def class_floors(
    shape: ModelShape,
    dtype_bytes: int,
    rows: Sequence[tuple[int, int]],
    sampled: int,
    rates: PeakRates,
) -> dict[str, float]:
    """Seconds each class needs at the least for a step of `rows` (per request: tokens
    computed, keys after) sampling `sampled` rows; "other" has no floor (0)."""
    cost = step_cost(shape, dtype_bytes, rows, sampled)
    tokens = sum(q for q, _ in rows)
    f, b = rates.flops, rates.bandwidth
    return {
        "gemm": max(cost.gemm_flops / f, cost.weight_bytes / b),
        "attention": max(cost.attention_flops / f, cost.kv_bytes / b),
        "elementwise": tokens * elementwise_bytes_per_token(shape, dtype_bytes) / b,
        "sampling": sampled * shape.vocab * 4 / b,  # (float32 logits, read once)
        "other": 0.0,
    }
