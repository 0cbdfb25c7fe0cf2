"""Decode attention configs against the one `choose_config` picks, for the Qwen3-0.6B
layer shape (16 q heads, 8 KV heads, head 128, blocks of 16), bf16, CUDA-graph replay of
the attention launch (and its split merge). A captured graph fixes the config for every
context its batch size meets, so the table is per batch size across contexts.

Small batches (the default) at short contexts, where a step's attention is bound by
latency, not bandwidth: tile sizes and KV split counts, µs per layer. `--large`: batches
of 64-256 at the throughput workload's contexts (0.5-1.5k keys), where it is bound by
its KV reads: tile sizes, warps, pipeline depth and splits, µs and the fraction of the
KV-read floor.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/sweep_decode.py [--large]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from asyncllm_kernels.paged_attention import AttentionConfig, choose_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import HKV, HQ, D, decode_row  # noqa: E402
from timing import write_json  # noqa: E402

SMALL = dict(batches=(1, 4, 16), contexts=(128, 384, 640, 1024, 2048, 4096))
LARGE = dict(batches=(64, 128, 256), contexts=(512, 1024, 1536))


def candidates(chosen: AttentionConfig, large: bool) -> list[AttentionConfig]:
    if large:
        grid = itertools.product((64, 128, 256), (1, 2), ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4)))
    else:
        grid = itertools.product(
            (32, 64, 128), sorted({1, 4, 8, 16, chosen.num_splits}), ((4, 2), (8, 3))
        )
    configs = [chosen] + [
        AttentionConfig(chosen.block_m, bn, splits, warps, stages)
        for bn, splits, (warps, stages) in grid
    ]
    return list(dict.fromkeys(configs))


def main() -> None:
    large = "--large" in sys.argv
    preset = LARGE if large else SMALL
    dev = torch.device("cuda")
    rows = []
    for batch in preset["batches"]:
        chosen = choose_config(batch, HKV, HQ // HKV, D, True, dev)
        for cfg in candidates(chosen, large):
            try:
                cells = [
                    decode_row(batch, ctx, cfg, rotations=None if large else 8)
                    for ctx in preset["contexts"]
                ]
            except OutOfResources:
                continue
            mark = " (chosen)" if cfg == chosen else ""
            print(f"batch {batch:3d} bn {cfg.block_n:3d} splits {cfg.num_splits:3d} warps "
                  f"{cfg.num_warps} stages {cfg.num_stages}: "
                  + " ".join(f"{c['us']:7.1f} ({c['ratio']:.2f})" for c in cells) + mark,
                  flush=True)  # fmt: skip
            rows.append(dict(batch=batch, config=str(cfg), chosen=cfg == chosen,
                             contexts=list(preset["contexts"]), cells=cells))  # fmt: skip
    write_json("sweep_large_decode" if large else "sweep_small_decode", rows)


if __name__ == "__main__":
    main()
