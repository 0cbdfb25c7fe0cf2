"""The small-batch linear layers (M = 1-16 rows) of the benchmark shapes: every
`skinny_gemm` config against cuBLAS (`F.linear`), bf16, CUDA-graph replay over enough
weight copies that each call reads its weight from device memory (not L2). Prints, per
shape and M, cuBLAS's time and bandwidth, the best config's, and the config that is best
over all M (the one `TUNED` should hold), with its worst ratio to cuBLAS.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/sweep_skinny_gemm.py [--quick] [--m1] [SHAPE ...]

(SHAPE: a name of SHAPES, such as llama8b.qkv, or "moe" for MOE_SHAPES: only those shapes;
--m1: M = 1 only. The JSON under $OUT is sweep_skinny_gemm[_SHAPES].json.)
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from asyncllm_kernels.skinny_gemm import SkinnyConfig, skinny_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import COPY_BW, graph_time_calls_us, write_json  # noqa: E402

# (name, N, K): the fused qkv, o_proj, fused gate_up and down_proj of each dense shape.
DENSE_SHAPES = [
    ("llama8b.qkv", 6144, 4096),
    ("llama8b.o", 4096, 4096),
    ("llama8b.gate_up", 28672, 4096),
    ("llama8b.down", 4096, 14336),
    ("qwen06b.qkv", 4096, 1024),
    ("qwen06b.o", 1024, 2048),
    ("qwen06b.gate_up", 6144, 1024),
    ("qwen06b.down", 1024, 3072),
]
# The dense layers of the mixture-of-experts shapes (their experts are fused_moe's):
# Qwen3-30B-A3B's qkv, o_proj and router; DeepSeek-V2-Lite's q_proj, kv_a_proj_with_mqa,
# o_proj, router and its two shared experts' gate_up and down.
MOE_SHAPES = [
    ("qwen30b.qkv", 5120, 2048),
    ("qwen30b.o", 2048, 4096),
    ("qwen30b.router", 128, 2048),
    ("dsv2lite.router", 64, 2048),
    ("dsv2lite.q", 3072, 2048),
    ("dsv2lite.kv_a", 576, 2048),
    ("dsv2lite.o", 2048, 2048),
    ("dsv2lite.shared_gate_up", 5632, 2048),
    ("dsv2lite.shared_down", 2048, 2816),
]
SHAPES = DENSE_SHAPES + MOE_SHAPES
MS = (1, 2, 4, 8, 16)
L2_BYTES = 50 << 20


def configs(quick: bool, m: int) -> list[SkinnyConfig]:
    """The tiles tried at M rows; at M = 1 also the one-row form's (fewer than 16 rows of
    w a program, no tl.dot and no software pipeline: its stages do not matter)."""
    if quick:
        return [SkinnyConfig(16, 256, 4, 4), SkinnyConfig(32, 256, 4, 4)]
    dot = [
        SkinnyConfig(bn, bk, w, s)
        for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))
        if bn * bk <= 32 * 512
    ]
    if m != 1:
        return dot
    one_row = [
        SkinnyConfig(bn, bk, w, 1)
        for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8))
        if bn * bk <= 4 * 2048
    ]
    return dot + one_row


def time_calls(fn, x, weights) -> float:
    return graph_time_calls_us([lambda w=w: fn(x, w) for w in weights])


def main() -> None:
    quick = "--quick" in sys.argv
    ms = (1,) if "--m1" in sys.argv else MS
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    tag = "_".join(a.replace(".", "-") for a in only)
    if "moe" in only:
        only = [a for a in only if a != "moe"] + [name for name, _, _ in MOE_SHAPES]
    unknown = set(only) - {name for name, _, _ in SHAPES}
    if unknown:
        raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {[s[0] for s in SHAPES]}")
    shapes = [s for s in SHAPES if not only or s[0] in only]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, n, k in shapes:
        nbytes = n * k * 2
        copies = max(4, min(64, -(-4 * L2_BYTES // nbytes)))
        weights = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
        ]
        per_config: dict[SkinnyConfig, dict[int, float]] = {}
        cublas: list[float] = []
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cublas.append(time_calls(F.linear, x, weights))
            want = F.linear(x.float(), weights[0].float())
            for cfg in configs(quick, m):
                try:
                    got = skinny_gemm(x, weights[0], cfg).float()
                except OutOfResources:
                    continue
                err = ((got - want).norm() / want.norm()).item()
                if err > 1e-2:
                    raise AssertionError(f"{name} M={m} {cfg}: relative error {err}")
                us = time_calls(lambda a, b, c=cfg: skinny_gemm(a, b, c), x, weights)
                per_config.setdefault(cfg, {})[m] = us
        floor = nbytes / COPY_BW * 1e6
        for i, m in enumerate(ms):
            best_cfg = min(
                (c for c in per_config if m in per_config[c]), key=lambda c: per_config[c][m]
            )
            best = per_config[best_cfg][m]
            print(
                f"{name:16s} M={m:2d} floor {floor:7.1f} us | cuBLAS {cublas[i]:7.1f} us "
                f"({floor / cublas[i]:4.2f}) | best {best:7.1f} us ({floor / best:4.2f}) {best_cfg}",
                flush=True,
            )
        # One config for every M: the smallest worst ratio to cuBLAS.
        full = [c for c in per_config if len(per_config[c]) == len(ms)]
        overall = min(full, key=lambda c: max(per_config[c][m] / cb for m, cb in zip(ms, cublas)))
        ratios = [per_config[overall][m] / cb for m, cb in zip(ms, cublas)]
        print(
            f"{name:16s} one config for all M: {overall}: time / cuBLAS "
            + " ".join(f"{r:4.2f}" for r in ratios),
            flush=True,
        )
        rows.append(
            dict(
                shape=name,
                n=n,
                k=k,
                floor_us=floor,
                cublas_us=cublas,
                overall=str(overall),
                overall_us=[per_config[overall][m] for m in ms],
                ms=list(ms),
                times={str(c): {str(m): us for m, us in t.items()} for c, t in per_config.items()},
            )
        )
        del weights
        torch.cuda.empty_cache()
    write_json("sweep_skinny_gemm" + (f"_{tag}" if tag else ""), rows)


if __name__ == "__main__":
    main()
