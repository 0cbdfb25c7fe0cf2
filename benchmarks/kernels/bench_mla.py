"""Latent-attention decode on DeepSeek-V2-Lite's shape (16 heads, a latent of 512 + 64
rope values per token, blocks of 16 tokens), bf16: the Triton kernel (`mla_decode`, the
`triton_mla` backend's) and, where the flashinfer extra is installed, FlashInfer's
`BatchMLAPagedAttentionWrapper` on the same packed cache ([blocks, 16, 576], the
engine's layout), with its "auto" choice and each backend named in BACKENDS that plans.

Each row first checks every kernel against the float32 reference on a small batch (the
largest relative error of its output), then times batch x context: µs per layer from
CUDA-graph replay over enough block-table copies that the latents read exceed L2 (a
FlashInfer plan per copy, made before the capture), and the fraction of the KV-read
floor at COPY_BW. A backend that does not plan or run on this device prints why, once.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/bench_mla.py [--batch B ...] [--ctx N ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from asyncllm_kernels.mla_decode import mla_decode
from asyncllm_kernels.reference import mla_decode_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import COPY_BW, graph_time_calls_us, write_json  # noqa: E402

H, L, R, BLOCK = 16, 512, 64, 16
SCALE = 0.1352  # (DeepSeek-V2-Lite's: (128 + 64) ** -0.5 with YaRN's mscale, rounded)
L2_BYTES = 50 << 20
BACKENDS = ("fa2", "fa3")


def make_tables(batch: int, ctx: int, copies: int, device) -> tuple[torch.Tensor, list]:
    """A cache holding `copies` disjoint sets of `batch` sequences of `ctx` tokens each, and
    each copy's [batch, width] block table (blocks shuffled)."""
    width = -(-ctx // BLOCK)
    blocks = torch.randperm(copies * batch * width, device=device).to(torch.int32)
    cache = torch.randn(copies * batch * width, BLOCK, L + R, device=device, dtype=torch.bfloat16)
    return cache, [t.view(batch, width) for t in blocks.split(batch * width)]


class FlashInferMLA:
    """One planned wrapper per block table (plan outside the graph, run inside)."""

    def __init__(self, backend: str, tables: list[torch.Tensor], seq_lens: torch.Tensor):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        device = seq_lens.device
        batch = seq_lens.shape[0]
        self.wrappers = []
        for table in tables:
            pages = -(-seq_lens // BLOCK)
            kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
            kv_indptr[1:] = torch.cumsum(pages, 0)
            indices = torch.cat([table[i, : int(pages[i])] for i in range(batch)])
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
            wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=backend)
            wrapper.plan(
                metadata=MLAPlanMetadata.csr(
                    torch.arange(batch + 1, dtype=torch.int32, device=device),
                    kv_indptr,
                    indices.to(torch.int32),
                    seq_lens.to(torch.int32),
                ),
                num_heads=H,
                head_dim_ckv=L,
                head_dim_kpe=R,
                page_size=BLOCK,
                causal=False,
                sm_scale=SCALE,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
                query_layout="packed",
                kv_cache_layout="packed",
            )
            self.wrappers.append(wrapper)
        self.name = getattr(self.wrappers[0], "_planned_backend_name", None) or backend

    def __call__(self, i: int, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return self.wrappers[i].run(query=q, kv_cache=cache)


def kernels(tables, seq_lens, failed: dict[str, str]) -> dict[str, object]:
    """name -> fn(i, q, cache) for the Triton kernel and each FlashInfer backend that plans."""
    found: dict[str, object] = {
        "triton": lambda i, q, cache: mla_decode(q, cache, tables[i], seq_lens, SCALE, L)
    }
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        failed.setdefault("flashinfer", "not installed")
        return found
    for backend in ("auto", *BACKENDS):
        name = f"flashinfer {backend}"
        if name in failed:
            continue
        try:
            fi = FlashInferMLA(backend, tables, seq_lens)
        except Exception as e:  # (a backend this device or layout does not support)
            failed[name] = f"{type(e).__name__}: {e}"[:300]
            continue
        if backend == "auto":
            print(f"flashinfer auto plans {fi.name}", flush=True)
        found[name] = fi
    return found


def check(device, failed: dict[str, str]) -> dict[str, float]:
    """Each kernel's largest error against the float32 reference, relative to its largest
    value, on 4 sequences of 40-700 tokens."""
    lens = torch.tensor([700, 40, 333, 129], dtype=torch.int32, device=device)
    width = -(-700 // BLOCK)
    cache, tables = make_tables(4, width * BLOCK, 1, device)
    q = torch.randn(4, H, L + R, device=device, dtype=torch.bfloat16)
    want = mla_decode_ref(q.float(), cache.float(), tables[0], lens, SCALE, L).float()
    errors = {}
    for name, fn in kernels(tables, lens, failed).items():
        try:
            got = fn(0, q, cache).float()
        except Exception as e:
            failed.setdefault(name, f"{type(e).__name__}: {e}"[:300])
            continue
        errors[name] = float((got - want).abs().max() / want.abs().max())
    return errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048, 8192])
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    failed: dict[str, str] = {}
    errors = check(device, failed)
    print("largest error / largest value, against float32:", flush=True)
    for name, err in errors.items():
        print(f"  {name}: {err:.2e}", flush=True)
    rows = []
    for batch in args.batch:
        for ctx in args.ctx:
            kv_bytes = batch * ctx * (L + R) * 2
            copies = max(1, min(16, -(-4 * L2_BYTES // kv_bytes)))
            if copies * kv_bytes > 24 << 30:
                continue
            cache, tables = make_tables(batch, ctx, copies, device)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, H, L + R, device=device, dtype=torch.bfloat16)
            floor = kv_bytes / COPY_BW * 1e6
            cells = {}
            for name, fn in kernels(tables, seq_lens, failed).items():
                calls = [lambda i=i, f=fn, q=q, c=cache: f(i, q, c) for i in range(copies)]
                try:
                    cells[name] = graph_time_calls_us(calls)
                except Exception as e:
                    failed.setdefault(name, f"{type(e).__name__}: {e}"[:300])
            print(
                f"batch {batch:3d} x {ctx:5d} keys, floor {floor:7.1f} µs | "
                + " | ".join(f"{n} {us:7.1f} ({floor / us:.2f})" for n, us in cells.items()),
                flush=True,
            )
            rows.append(dict(batch=batch, ctx=ctx, floor_us=floor, us=cells))
            del cache, tables
            torch.cuda.empty_cache()
    for name, why in failed.items():
        print(f"{name}: not timed: {why}", flush=True)
    write_json("bench_mla", rows, meta=dict(errors=errors, failed=failed))


if __name__ == "__main__":
    main()
