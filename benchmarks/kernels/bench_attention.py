"""Paged attention on one layer of Qwen3-0.6B's shape (16 q heads, 8 KV heads, head 128,
block size 16, shuffled block tables), bf16.

Decode rows: the floor is the bytes that must move (K and V of every context token, q
and out) over the copy bandwidth. Prefill row: causal, FLOPs = 2 * S^2 * D * H per
sequence. Every time is the median CUDA-graph replay of a launch sequence over
`--rotations` batches whose block tables point at disjoint parts of one cache, so no
batch finds the previous one's keys in L2.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/bench_attention.py

`--backend NAME` (or `all`: every registered CUDA backend that is installed) times the
attention backends themselves, through `build_metadata` and `forward` (the K/V write
launch included, writing nothing), side by side: decode rows at short and long contexts
from batch 1 to 256, the mixed row and the prefill row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm.model.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from asyncllm.model.attention.registry import (
    AttentionNeeds,
    attention_backend_names,
    find_attention_backend,
)
from asyncllm_kernels.paged_attention import AttentionConfig, choose_config, paged_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import floor_us, graph_time_calls_us, measure_copy_bw, write_json  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16
DECODE = [(256, 4096), (64, 16384), (1, 131072), (32, 1024)]
TARGET = {(256, 4096): 0.85, (64, 16384): 0.85, (1, 131072): 0.70, (32, 1024): 0.60}


def time_attention(q_lens: list[int], ctx: int, rotations: int, config=None, has_decodes=False):
    """One chunk of `q_lens[i]` tokens per sequence, each ending at `ctx`; `rotations`
    batches whose block tables point at disjoint, shuffled parts of one cache."""
    seqs, T = len(q_lens), sum(q_lens)
    blocks_per_seq = -(-ctx // BS)
    total = seqs * blocks_per_seq * rotations
    kc = torch.randn(total, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(total, device="cuda").to(torch.int32)
    tables = tables.view(rotations, seqs, blocks_per_seq)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.zeros(seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    qsl = qsl.cuda()
    qs = [torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(rotations)]
    outs = [torch.empty_like(q) for q in qs]
    calls = [
        lambda i=i: paged_attention(
            qs[i],
            kc,
            vc,
            tables[i],
            seq_lens,
            qsl,
            D**-0.5,
            max_query_len=max(q_lens),
            has_decodes=has_decodes,
            out=outs[i],
            config=config,
        )
        for i in range(rotations)
    ]
    return graph_time_calls_us(calls, replays=30)


# Decode shapes of the backends' side-by-side table: short and long contexts, batch 1
# to 256 ((256, 160): the short contexts of a chat workload's decode steps).
BACKEND_DECODE = [(1, 1024), (1, 131072), (32, 1024), (64, 16384), (256, 160), (256, 4096)]


def time_backend(name: str, q_lens: list[int], ctx: int, rotations: int) -> float:
    """`time_attention` through a registered backend: one instance per rotation (a
    backend that plans on the host holds one plan per wrapper); decode batches are
    built as a decode graph's."""
    entry = find_attention_backend(name, AttentionNeeds(torch.device("cuda"), torch.bfloat16, D))
    seqs, T = len(q_lens), sum(q_lens)
    blocks_per_seq = -(-ctx // BS)
    total = seqs * blocks_per_seq * rotations
    kv = torch.randn(2, total, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(total).to(torch.int32).view(rotations, seqs, blocks_per_seq)
    qsl = np.zeros(seqs + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    seq_lens = np.full(seqs, ctx, dtype=np.int32)
    slots = np.full(T, -1, dtype=np.int64)
    spec = AttentionLayerSpec(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D**-0.5)
    kv_new = torch.zeros(T, HKV, D, device="cuda", dtype=torch.bfloat16)
    backends, mds = [], []
    for i in range(rotations):
        backend = entry.load()
        common = CommonAttentionMetadata.from_numpy(qsl, seq_lens, tables[i].numpy(), slots, "cuda")
        common.for_cuda_graph = max(q_lens) == 1
        backends.append(backend)
        mds.append(backend.build_metadata(common, BS))
    qs = [torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(rotations)]
    calls = [
        lambda i=i: backends[i].forward(spec, qs[i], kv_new, kv_new, kv, mds[i])
        for i in range(rotations)
    ]
    return graph_time_calls_us(calls, replays=30)


def backend_rows(names: list[str]) -> list[dict]:
    """The decode, mixed and prefill rows of every backend in `names`, side by side."""
    rows = []
    for batch, ctx in BACKEND_DECODE:
        kv_bytes = batch * ctx * HKV * D * 2 * 2
        rotations = max(1, min(8, int(2e9 // kv_bytes)))
        moved = kv_bytes + 2 * batch * HQ * D * 2 + batch * (-(-ctx // BS)) * 4
        floor = floor_us(moved)
        for name in names:
            us = time_backend(name, [1] * batch, ctx, rotations)
            rows.append(dict(kind="decode", backend=name, batch=batch, ctx=ctx, us=us,
                             floor_us=floor, ratio=floor / us))  # fmt: skip
            print(f"decode {batch:4d} x {ctx:6d}  {name:12s} {us:9.1f} us  floor {floor:8.1f}"
                  f"  ratio {floor / us:.2f}", flush=True)  # fmt: skip
    decodes, ctx, chunk = 64, 4096, 512
    moved = (decodes + 1) * ctx * HKV * D * 2 * 2 + 2 * (decodes + chunk) * HQ * D * 2
    for name in names:
        us = time_backend(name, [1] * decodes + [chunk], ctx, 4)
        rows.append(dict(kind="mixed", backend=name, batch=decodes, ctx=ctx, chunk=chunk,
                         us=us, floor_us=floor_us(moved), ratio=floor_us(moved) / us))  # fmt: skip
        print(f"mixed 64 decodes + 512-token chunk at 4k  {name:12s} {us:9.1f} us"
              f"  bandwidth floor {floor_us(moved):.1f}", flush=True)  # fmt: skip
    for name in names:
        us = time_backend(name, [4096] * 4, 4096, 2)
        tflops = 4 * 2 * 4096 * 4096 * D * HQ / us / 1e6
        rows.append(dict(kind="prefill", backend=name, batch=4, ctx=4096, us=us, tflops=tflops))
        print(f"prefill 4 x 4096 causal  {name:12s} {us:9.1f} us  {tflops:.0f} TFLOP/s", flush=True)
    return rows


def installed_cuda_backends() -> list[str]:
    """The registered backends that serve this bench's layer on CUDA and are installed."""
    needs = AttentionNeeds(torch.device("cuda"), torch.bfloat16, D, BS)
    names = []
    for name in attention_backend_names():
        try:
            find_attention_backend(name, needs)
        except ValueError:
            continue
        if name.startswith("torch"):
            continue  # (the reference: not a serving kernel)
        names.append(name)
    return names


def decode_row(batch, ctx, config=None, rotations=None):
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    rotations = rotations or max(1, min(8, int(2e9 // kv_bytes)))
    us = time_attention([1] * batch, ctx, rotations, config)
    torch.cuda.empty_cache()  # the caches of this row are gone: give their memory back
    moved = kv_bytes + 2 * batch * HQ * D * 2 + batch * (-(-ctx // BS)) * 4
    floor = floor_us(moved)
    return dict(kind="decode", batch=batch, ctx=ctx, us=us, floor_us=floor, ratio=floor / us)


def prefill_row(batch, seq, config=None):
    us = time_attention([seq] * batch, seq, 2, config)
    flops = batch * 2 * seq * seq * D * HQ
    return dict(kind="prefill", batch=batch, ctx=seq, us=us, tflops=flops / us / 1e6)


def mixed_row(decodes: int, ctx: int, chunk: int, two_launches: bool) -> dict:
    """`decodes` sequences decoding at `ctx`, plus one prefill chunk of `chunk` tokens
    ending at `ctx`: the batch a chunked-prefill step gives."""
    us = time_attention([1] * decodes + [chunk], ctx, 4, has_decodes=two_launches)
    seqs, T = decodes + 1, decodes + chunk
    moved = seqs * ctx * HKV * D * 2 * 2 + 2 * T * HQ * D * 2
    floor = floor_us(moved)
    return dict(kind="mixed", batch=decodes, ctx=ctx, chunk=chunk, two_launches=two_launches,
                us=us, floor_us=floor, ratio=floor / us)  # fmt: skip


def sdpa_prefill(batch, seq):
    q = torch.randn(batch, HQ, seq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, seq, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        k2, v2 = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        us = graph_time_calls_us(
            [lambda: F.scaled_dot_product_attention(q, k2, v2, is_causal=True)]
        )
    return batch * 2 * seq * seq * D * HQ / us / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other tile/split choices")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--backend", help="time these backends side by side: a name, or all")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {measure_copy_bw() / 1e12:.2f} TB/s")
    if args.backend:
        names = installed_cuda_backends() if args.backend == "all" else args.backend.split(",")
        print("backends:", ", ".join(names))
        write_json("bench_attention_backends", backend_rows(names))
        return
    rows = []
    for batch, ctx in DECODE:
        cfg = choose_config(batch, HKV, HQ // HKV, D, True, dev)
        row = decode_row(batch, ctx)
        row.update(config=str(cfg), target=TARGET[(batch, ctx)])
        rows.append(row)
        print(f"decode {batch:4d} x {ctx:6d}: {row['us']:9.1f} us  floor {row['floor_us']:8.1f}"
              f"  ratio {row['ratio']:.2f} (target {row['target']:.2f})  {cfg}", flush=True)  # fmt: skip
        if args.sweep:
            near = {cfg.num_splits // 2, cfg.num_splits, cfg.num_splits * 2} - {0}
            for splits in sorted(near):
                for bn, warps, stages in (
                    (64, 4, 3),
                    (32, 4, 4),
                    (64, 4, 4),
                    (128, 8, 3),
                    (64, 8, 3),
                ):
                    alt = AttentionConfig(cfg.block_m, bn, splits, warps, stages)
                    if alt == cfg:
                        continue
                    r = decode_row(batch, ctx, alt)
                    print(f"   sweep {alt}: {r['us']:9.1f} us ratio {r['ratio']:.2f}", flush=True)
    for two in (False, True):
        row = mixed_row(64, 4096, 512, two)
        rows.append(row)
        print(f"mixed 64 decodes + 512-token chunk at 4k, {'two launches' if two else 'one launch'}:"
              f" {row['us']:8.1f} us  bandwidth floor {row['floor_us']:.1f}", flush=True)  # fmt: skip
    if not args.no_prefill:
        row = prefill_row(4, 4096)
        row["target_tflops"] = 300
        row["sdpa_flash_tflops"] = sdpa_prefill(4, 4096)
        rows.append(row)
        print(f"prefill 4 x 4096 causal: {row['us']:9.1f} us  {row['tflops']:.0f} TFLOP/s"
              f" (target 300; SDPA flash {row['sdpa_flash_tflops']:.0f})", flush=True)  # fmt: skip
        if args.sweep:
            for bm, bn, warps, stages in (
                (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                (128, 32, 8, 4), (64, 128, 4, 3),
            ):  # fmt: skip
                alt = AttentionConfig(bm, bn, 1, warps, stages)
                r = prefill_row(4, 4096, alt)
                print(f"   sweep {alt}: {r['us']:9.1f} us {r['tflops']:.0f} TFLOP/s", flush=True)
    write_json("bench_attention", rows)


if __name__ == "__main__":
    main()
