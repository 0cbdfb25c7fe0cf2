"""Microbenchmarks of the row-wise Triton kernels against their torch references, on CUDA
in bfloat16, with the shapes of a Qwen3-0.6B layer.

Kernels: reshape_and_cache (KV cache write), rms_norm (plain and with the fused residual),
silu_and_mul, and the in-place rotary on q and k. Each row gives the kernel's time per
call (CUDA graph, median, see timing.py), the bytes it must move (each input read once,
each output written once), the time those bytes take at the device's copy bandwidth, the
ratio of the two, and the time of the plain-torch reference.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/bench_elementwise.py
    PYTHONPATH=src:kernels python3 benchmarks/kernels/bench_elementwise.py --tokens 1 4096

With OUT set, the rows are also written to $OUT/bench_elementwise.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncllm_kernels.elementwise import reshape_and_cache, rms_norm, silu_and_mul
from asyncllm_kernels.reference import (
    apply_rotary_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from asyncllm_kernels.rotary import apply_rotary_

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (  # noqa: E402
    COPY_BW,
    device_meta,
    eager_time_us,
    floor_us,
    graph_time_us,
    measure_copy_bw,
    print_rows,
    write_json,
)

# Qwen3-0.6B
HIDDEN = 1024
Q_HEADS = 16
KV_HEADS = 8
HEAD = 128
INTERMEDIATE = 3072
BLOCK_SIZE = 16
MAX_POSITION = 40960
ROPE_THETA = 1e6
EPS = 1e-6

DTYPE = torch.bfloat16
DEV = "cuda"
EL = DTYPE.itemsize
TOKENS = [1, 64, 256, 4096, 16384]


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE, device=DEV)


def _cos_sin_cache(max_pos: int, rot_dim: int, theta: float) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=DEV) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=DEV), inv)
    return torch.cat([freqs.cos(), freqs.sin()], -1).contiguous()


@dataclass
class Case:
    """One benchmark row: inputs, the kernel, its reference, and the bytes it moves."""

    name: str
    make_inputs: Callable[[], tuple]
    kernel: Callable
    ref: Callable
    bytes_moved: int
    # False for a reference that synchronises with the host: it is then timed eagerly.
    ref_capturable: bool = True


def reshape_and_cache_case(T: int, pad: int = 0) -> Case:
    """T tokens written to a cache of at least 2T slots at shuffled slots; the last `pad`
    tokens have slot -1 (skipped: counted as reading their slot entry only)."""
    width = KV_HEADS * HEAD
    num_blocks = math.ceil(max(2 * T, 1024) / BLOCK_SIZE)
    written = T - pad

    def make_inputs():
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:T].clone()
        if pad:
            slots[written:] = -1
        return (
            _randn(T, KV_HEADS, HEAD),
            _randn(T, KV_HEADS, HEAD),
            _randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD),
            _randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD),
            slots,
        )

    # key + value read, key_cache + value_cache written (live tokens only), slots read.
    nbytes = 4 * written * width * EL + T * 8
    # The reference indexes with a boolean mask, which synchronises with the host.
    name = "reshape_and_cache" + (f"(pad {pad})" if pad else "")
    return Case(name, make_inputs, reshape_and_cache, reshape_and_cache_ref, nbytes, False)


def rms_norm_case(T: int) -> Case:
    def make_inputs():
        return _randn(T, HIDDEN), _randn(HIDDEN), EPS

    # x and weight read, out written.
    nbytes = (2 * T * HIDDEN + HIDDEN) * EL
    return Case("rms_norm", make_inputs, rms_norm, rms_norm_ref, nbytes)


def rms_norm_residual_case(T: int) -> Case:
    def make_inputs():
        return _randn(T, HIDDEN), _randn(HIDDEN), EPS, _randn(T, HIDDEN)

    # x, residual and weight read; residual (in place) and out written.
    nbytes = (4 * T * HIDDEN + HIDDEN) * EL
    return Case("rms_norm+residual", make_inputs, rms_norm, rms_norm_ref, nbytes)


def silu_and_mul_case(T: int) -> Case:
    def make_inputs():
        return (_randn(T, 2 * INTERMEDIATE),)

    # [T, 2I] read, [T, I] written.
    nbytes = 3 * T * INTERMEDIATE * EL
    return Case("silu_and_mul", make_inputs, silu_and_mul, silu_and_mul_ref, nbytes)


def rotary_case(T: int, cache: torch.Tensor) -> Case:
    rot_dim = cache.shape[-1]

    def make_inputs():
        # Distinct positions: each token reads its own cos/sin row.
        pos = torch.randperm(cache.shape[0], device=DEV)[:T].clone()
        return pos, _randn(T, Q_HEADS, HEAD), _randn(T, KV_HEADS, HEAD), cache

    def ref(pos, q, k, cache):
        return apply_rotary_ref(pos, q, cache), apply_rotary_ref(pos, k, cache)

    # q and k read and written in place, positions (int64) and T cos/sin rows (fp32) read.
    nbytes = 2 * T * (Q_HEADS + KV_HEADS) * HEAD * EL + T * 8 + T * rot_dim * 4
    return Case("rotary(neox)", make_inputs, apply_rotary_, ref, nbytes)


HEADER = ["kernel", "tokens", "us", "bytes", "floor_us", "floor/time", "ref_us", "ref/kernel"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--rotations", type=int, default=8, help="input sets per graph")
    ap.add_argument("--replays", type=int, default=50, help="timed graph replays")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch references")
    ap.add_argument("--no-copy-bw", action="store_true", help="skip measuring copy bandwidth")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")

    torch.manual_seed(0)
    meta = device_meta()
    print(f"device: {meta['device']}  torch {meta['torch']}  triton {meta['triton']}")
    if not args.no_copy_bw:
        bw = measure_copy_bw()
        meta["copy_bw_measured"] = bw
        print(
            f"copy bandwidth: measured {bw / 1e12:.2f} TB/s, floor uses {COPY_BW / 1e12:.2f} TB/s"
        )
    meta["copy_bw_floor"] = COPY_BW
    print()

    cache = _cos_sin_cache(MAX_POSITION, HEAD, ROPE_THETA)
    kw = dict(rotations=args.rotations, replays=args.replays)
    rows = []
    for T in args.tokens:
        cases = [
            reshape_and_cache_case(T),
            rms_norm_case(T),
            rms_norm_residual_case(T),
            silu_and_mul_case(T),
            rotary_case(T, cache),
        ]
        if T >= 8:
            cases.insert(1, reshape_and_cache_case(T, pad=T // 8))
        for case in cases:
            print(f"  {case.name} T={T}", file=sys.stderr, flush=True)
            us = graph_time_us(case.make_inputs, case.kernel, **kw)
            floor = floor_us(case.bytes_moved)
            row = {
                "kernel": case.name,
                "tokens": T,
                "us": us,
                "bytes": case.bytes_moved,
                "floor_us": floor,
                "floor/time": floor / us,
            }
            if not args.no_ref:
                timer = graph_time_us if case.ref_capturable else eager_time_us
                ref_us = timer(case.make_inputs, case.ref, **kw)
                row["ref_us"] = ref_us
                row["ref/kernel"] = ref_us / us
                row["ref_timing"] = "graph" if case.ref_capturable else "eager"
            rows.append(row)
    print_rows(rows, HEADER)
    if not args.no_ref:
        print(
            "\nref_us of reshape_and_cache is timed eagerly, host included: its boolean mask"
            " synchronises with the host, so it cannot be captured in a graph."
        )
    path = write_json("bench_elementwise", rows, meta)
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
