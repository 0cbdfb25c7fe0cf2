"""Causal paged prefill configs against the one `choose_config` picks, for the Qwen3-0.6B
layer shape (16 q heads, 8 KV heads, head 128, blocks of 16), bf16, graph-replayed:
4 x 4,096 and 1 x 12,000 tokens, TFLOP/s counted as 2 * S^2 * D * H per sequence (the
issue's convention). The kernel variants: key tiles loaded as rows (`k_rows`) and the
running sums rescaled only when a maximum grew past 2^8 (`lazy_rescale`), then tile
shapes, warps and pipeline depths with both.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/sweep_prefill.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from asyncllm_kernels.paged_attention import AttentionConfig, choose_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import HKV, HQ, D, prefill_row  # noqa: E402
from timing import write_json  # noqa: E402

SHAPES = ((4, 4096), (1, 12000))


def candidates(chosen: AttentionConfig) -> list[AttentionConfig]:
    variants = [
        dataclasses.replace(chosen, k_rows=k, lazy_rescale=lazy)
        for k in (False, True)
        for lazy in (False, True)
    ]
    tiles = [
        AttentionConfig(bm, bn, 1, warps, stages, k_rows=True, lazy_rescale=True)
        for bm, bn, warps, stages in (
            (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 4),
            (64, 128, 4, 3), (256, 64, 8, 2), (128, 32, 4, 4),
        )
    ]  # fmt: skip
    return list(dict.fromkeys(variants + tiles))


def main() -> None:
    dev = torch.device("cuda")
    chosen = choose_config(4, HKV, HQ // HKV, D, False, dev)
    rows = []
    for cfg in candidates(chosen):
        try:
            cells = [prefill_row(b, s, cfg) for b, s in SHAPES]
        except OutOfResources:
            print(f"{cfg}: out of resources", flush=True)
            continue
        mark = " (chosen)" if cfg == chosen else ""
        print(f"{cfg}: " + "  ".join(
            f"{b}x{s} {c['us']:8.1f} us {c['tflops']:4.0f} TFLOP/s"
            for (b, s), c in zip(SHAPES, cells)) + mark, flush=True)  # fmt: skip
        rows.append(dict(config=str(cfg), chosen=cfg == chosen, cells=cells))
    write_json("sweep_prefill", rows)


if __name__ == "__main__":
    main()
