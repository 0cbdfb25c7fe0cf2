"""Decode attention at large batches and the throughput workload's contexts (0.5-1.5k
keys), where a step's attention is bound by its KV reads: each tile size, warp count,
pipeline depth and split count against the one `choose_config` picks, for the
Qwen3-0.6B layer shape (16 q heads, 8 KV heads, head 128, blocks of 16), bf16,
CUDA-graph replay. Prints µs per layer and the fraction of the KV-read floor.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/sweep_large_decode.py
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

BATCHES = (64, 128, 256)
CONTEXTS = (512, 1024, 1536)


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for batch in BATCHES:
        chosen = choose_config(batch, HKV, HQ // HKV, D, True, dev)
        configs = [chosen] + [
            AttentionConfig(chosen.block_m, bn, splits, warps, stages)
            for bn, splits, (warps, stages) in itertools.product(
                (64, 128, 256), (1, 2), ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4))
            )
        ]
        seen = set()
        for cfg in configs:
            if cfg in seen:
                continue
            seen.add(cfg)
            try:
                cells = [decode_row(batch, ctx, cfg) for ctx in CONTEXTS]
            except OutOfResources:
                continue
            mark = " (chosen)" if cfg == chosen else ""
            print(f"batch {batch:3d} bn {cfg.block_n:3d} splits {cfg.num_splits} warps "
                  f"{cfg.num_warps} stages {cfg.num_stages}: "
                  + " ".join(f"{c['us']:7.1f} ({c['ratio']:.2f})" for c in cells) + mark,
                  flush=True)  # fmt: skip
            rows.append(dict(batch=batch, config=str(cfg), chosen=cfg == chosen,
                             contexts=list(CONTEXTS), cells=cells))  # fmt: skip
    write_json("sweep_large_decode", rows)


if __name__ == "__main__":
    main()
