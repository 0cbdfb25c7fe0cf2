"""Paged attention on one layer of Qwen3-0.6B's shape (16 q heads, 8 KV heads, head 128,
block size 16, shuffled block tables), bf16.

Decode rows: the floor is the bytes that must move (K and V of every context token, q
and out) over the copy bandwidth. Prefill row: causal, FLOPs = 2 * S^2 * D * H per
sequence. Every time is the median CUDA-graph replay of a launch sequence over
`--rotations` batches whose block tables point at disjoint parts of one cache, so no
batch finds the previous one's keys in L2.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/bench_attention.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from asyncllm_kernels.paged_attention import AttentionConfig, choose_config, paged_attention

HQ, HKV, D, BS = 16, 8, 128, 16
COPY_BW = 4.3e12
DECODE = [(256, 4096), (64, 16384), (1, 131072), (32, 1024)]
TARGET = {(256, 4096): 0.85, (64, 16384): 0.85, (1, 131072): 0.70, (32, 1024): 0.60}


def graph_time_us(fns, replays: int = 30) -> float:
    """Median time of one call, over graph replays of all `fns` in sequence."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(times)


def make_batches(batch: int, ctx: int, q_len: int, rotations: int):
    blocks_per_seq = -(-ctx // BS)
    total = batch * blocks_per_seq * rotations
    kc = torch.randn(total, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(total, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    perm = perm.view(rotations, batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    qs = [
        torch.randn(batch * q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
        for _ in range(rotations)
    ]
    outs = [torch.empty_like(q) for q in qs]
    return kc, vc, perm, seq_lens, qsl, qs, outs


def time_attention(batch, ctx, q_len, rotations, config=None):
    kc, vc, tables, seq_lens, qsl, qs, outs = make_batches(batch, ctx, q_len, rotations)
    fns = [
        (
            lambda i=i: paged_attention(
                qs[i],
                kc,
                vc,
                tables[i],
                seq_lens,
                qsl,
                D**-0.5,
                max_query_len=q_len,
                out=outs[i],
                config=config,
            )
        )  # fmt: skip
        for i in range(rotations)
    ]
    return graph_time_us(fns)


def decode_row(batch, ctx, config=None, rotations=None):
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    rotations = rotations or max(1, min(8, int(2e9 // kv_bytes)))
    us = time_attention(batch, ctx, 1, rotations, config)
    torch.cuda.empty_cache()
    moved = kv_bytes + 2 * batch * HQ * D * 2 + batch * (-(-ctx // BS)) * 4
    floor = moved / COPY_BW * 1e6
    return dict(kind="decode", batch=batch, ctx=ctx, us=us, floor_us=floor, ratio=floor / us)


def prefill_row(batch, seq, config=None):
    us = time_attention(batch, seq, seq, 2, config)
    flops = batch * 2 * seq * seq * D * HQ
    return dict(kind="prefill", batch=batch, ctx=seq, us=us, tflops=flops / us / 1e6)


def mixed_row(decodes: int, ctx: int, chunk: int, two_launches: bool) -> dict:
    """`decodes` sequences decoding at `ctx`, plus one prefill chunk of `chunk` tokens
    ending at `ctx`: the batch a chunked-prefill step gives."""
    rotations = 4
    blocks_per_seq = -(-ctx // BS)
    seqs = decodes + 1
    total = seqs * blocks_per_seq * rotations
    kc = torch.randn(total, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(total, device="cuda").to(torch.int32)
    tables = tables.view(rotations, seqs, blocks_per_seq)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    q_lens = torch.tensor([1] * decodes + [chunk], dtype=torch.int32)
    qsl = torch.zeros(seqs + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    qsl = qsl.cuda()
    T = decodes + chunk
    qs = [torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(rotations)]
    outs = [torch.empty_like(q) for q in qs]
    fns = [
        (
            lambda i=i: paged_attention(
                qs[i],
                kc,
                vc,
                tables[i],
                seq_lens,
                qsl,
                D**-0.5,
                max_query_len=chunk,
                has_decodes=two_launches,
                out=outs[i],
            )
        )  # fmt: skip
        for i in range(rotations)
    ]
    us = graph_time_us(fns)
    moved = seqs * ctx * HKV * D * 2 * 2 + 2 * T * HQ * D * 2
    floor = moved / COPY_BW * 1e6
    return dict(kind="mixed", batch=decodes, ctx=ctx, chunk=chunk, two_launches=two_launches,
                us=us, floor_us=floor, ratio=floor / us)  # fmt: skip


def sdpa_prefill(batch, seq):
    q = torch.randn(batch, HQ, seq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, seq, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        k2, v2 = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        us = graph_time_us([lambda: F.scaled_dot_product_attention(q, k2, v2, is_causal=True)])
    return batch * 2 * seq * seq * D * HQ / us / 1e6


def measure_copy_bw() -> float:
    """A copy kernel (not a graph memcpy node, which runs on the copy engines)."""
    a = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    us = graph_time_us([lambda: torch.neg(a, out=b)])
    return 2 * a.numel() * 2 / (us * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other tile/split choices")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {measure_copy_bw() / 1e12:.2f} TB/s")
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
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
