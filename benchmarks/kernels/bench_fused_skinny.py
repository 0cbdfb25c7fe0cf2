"""The small-batch linear layers with their neighbours fused (skinny_gemm's norm, gated and
add variants) against the same work in separate launches, bf16, CUDA-graph replay over
enough weight copies that each call reads its weight from device memory.

Per dense shape and M: "apart" is what a decoder layer ran before the fusion (the fused
residual-add RMSNorm kernel, then the GEMM as `LinearBase` picks it, then silu_and_mul
for gate/up; o_proj and down: the GEMM alone, its add being in the next norm's launch),
"plain" the skinny kernel alone with `fused_config` (gate/up: with its gate), "fused"
the one launch with its neighbours (the norm's weight folded into w), at `fused_config`'s
tiles and others; "(the layers')" marks the one the layers run.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/bench_fused_skinny.py [--m M] [SHAPE ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from asyncllm_kernels.elementwise import rms_norm, silu_and_mul
from asyncllm_kernels.skinny_gemm import (
    SkinnyConfig,
    fused_config,
    skinny_config,
    skinny_gemm,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_skinny_gemm import DENSE_SHAPES, L2_BYTES  # noqa: E402
from timing import COPY_BW, graph_time_calls_us, write_json  # noqa: E402

MS = (1, 4, 16)
OTHER_TILES = [
    SkinnyConfig(bn, bk, 4, s)
    for bn, bk, s in ((16, 512, 3), (32, 512, 3), (16, 256, 4), (32, 256, 4), (64, 128, 4))
]


def tag(cfg: SkinnyConfig) -> str:
    return f"{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}"


def time_case(part: str, m: int, weights: list[torch.Tensor], g: torch.Tensor) -> dict[str, float]:
    """µs per call of each way to run layer `part` at M = m over `weights`."""
    n, k = weights[0].shape
    gated, norm, add = part == "gate_up", part in ("qkv", "gate_up"), part in ("o", "down")
    x = torch.randn(m, k, device=g.device, dtype=torch.bfloat16)
    res = torch.randn(m, (n // 2 if gated else n) if add else k, device=g.device, dtype=x.dtype)

    def apart(w):
        h = rms_norm(x, g, 1e-6, res) if norm else x
        cfg = skinny_config(m, n, k, h.dtype)
        y = skinny_gemm(h, w, cfg) if cfg is not None else F.linear(h, w)
        return silu_and_mul(y) if gated else y

    def fused(w, cfg):  # (w stands for the weight with the norm's folded in)
        return skinny_gemm(
            res if norm else x,
            w,
            cfg,
            norm=norm,
            gated=gated,
            add_to=res if add else None,
        )

    def timed(fn) -> float:
        return graph_time_calls_us([lambda w=w: fn(w) for w in weights])

    cfg = fused_config(m, n, k, torch.bfloat16, gated, norm=norm)
    plain = fused_config(m, n, k, torch.bfloat16, gated)
    times = {
        "apart": timed(apart),
        f"plain {tag(plain)}": timed(lambda w: skinny_gemm(x, w, plain, gated=gated)),
    }
    for tiles in [cfg, *(t for t in OTHER_TILES if t != cfg)]:
        try:
            fused(weights[0], tiles)
        except OutOfResources:
            continue
        key = f"fused {tag(tiles)}" + (" (the layers')" if tiles == cfg else "")
        times[key] = timed(lambda w, c=tiles: fused(w, c))
    return times


def main() -> None:
    args = sys.argv[1:]
    ms = MS
    if "--m" in args:  # (one M only)
        i = args.index("--m")
        ms, args = (int(args[i + 1]),), args[:i] + args[i + 2 :]
    only = args
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, n, k in DENSE_SHAPES:
        if only and name not in only:
            continue
        copies = max(4, min(64, -(-4 * L2_BYTES // (n * k * 2))))
        weights = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
        ]
        g = 1 + torch.randn(k, device=dev) / 8
        for m in ms:
            times = time_case(name.split(".")[1], m, weights, g)
            floor = n * k * 2 / COPY_BW * 1e6
            print(
                f"{name:16s} M={m:2d} floor {floor:6.1f} | "
                + " | ".join(f"{key} {us:6.1f}" for key, us in times.items()),
                flush=True,
            )
            rows.append(dict(shape=name, m=m, floor_us=floor, times=times))
        del weights
        torch.cuda.empty_cache()
    write_json("bench_fused_skinny", rows)


if __name__ == "__main__":
    main()
