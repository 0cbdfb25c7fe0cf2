"""Decode attention at small batches and short contexts (where a step's attention is
launch- and latency-bound, not bandwidth-bound): each tile size and KV split count
against the one `choose_config` picks, for the Qwen3-0.6B layer shape (16 q heads, 8 KV
heads, head 128, blocks of 16), bf16, CUDA-graph replay of the attention launch (and
its split merge). A captured graph fixes the config for every context its batch size
meets, so the table is per batch size across contexts.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/sweep_small_decode.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from asyncllm_kernels.paged_attention import AttentionConfig, choose_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import HKV, HQ, D, decode_row  # noqa: E402
from timing import write_json  # noqa: E402

BATCHES = (1, 4, 16)
CONTEXTS = (128, 384, 640, 1024, 2048, 4096)


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for batch in BATCHES:
        chosen = choose_config(batch, HKV, HQ // HKV, D, True, dev)
        configs = [chosen] + [
            AttentionConfig(chosen.block_m, bn, splits, warps, stages)
            for bn in (32, 64, 128)
            for splits in sorted({1, 4, 8, 16, chosen.num_splits})
            for warps, stages in ((4, 2), (8, 3))
        ]
        seen = set()
        for cfg in configs:
            if cfg in seen:
                continue
            seen.add(cfg)
            times = [decode_row(batch, ctx, cfg, rotations=8)["us"] for ctx in CONTEXTS]
            mark = " (chosen)" if cfg == chosen else ""
            print(f"batch {batch:3d} bn {cfg.block_n:3d} splits {cfg.num_splits:3d} warps "
                  f"{cfg.num_warps} stages {cfg.num_stages}: "
                  + " ".join(f"{t:6.1f}" for t in times) + f"  sum {sum(times):7.1f}{mark}",
                  flush=True)  # fmt: skip
            rows.append(dict(batch=batch, config=str(cfg), chosen=cfg == chosen,
                             contexts=list(CONTEXTS), us=times))  # fmt: skip
    write_json("sweep_small_decode", rows)


if __name__ == "__main__":
    main()
