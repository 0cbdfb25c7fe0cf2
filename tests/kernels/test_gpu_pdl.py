"""Programmatic dependent launch (asyncllm_kernels/pdl.py) on the GPU: one decoder
layer's chain of this package's kernels (norm, skinny projections, rotation with the KV
cache write, split decode attention and its merge, activation), captured in a CUDA graph
with PDL on and replayed on new inputs, gives exactly what the same kernels give
launched one after another without it. Each kernel waits for the previous one before
it reads, so the results must not differ in a single bit."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels import pdl
from asyncllm_kernels.elementwise import rms_norm, silu_and_mul
from asyncllm_kernels.paged_attention import AttentionConfig, paged_attention
from asyncllm_kernels.rotary import rotate_into_kv_cache_
from asyncllm_kernels.skinny_gemm import SkinnyConfig, skinny_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HIDDEN, HQ, HKV, D, INTER, BLOCK, CTX = 1024, 16, 8, 128, 3072, 16, 700


def _layer(state, w):
    """One decode step of a Llama-style layer through this package's kernels only."""
    x, residual = state["x"], state["residual"]
    h = rms_norm(x, w["norm1"], 1e-6, residual=residual)
    qkv = skinny_gemm(h, w["qkv"], w["cfg"])
    T = qkv.shape[0]
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
    q = q.view(T, HQ, D).clone()  # (the rotation's q is rotated in place)
    k, v = k.view(T, HKV, D), v.view(T, HKV, D)
    rotate_into_kv_cache_(
        state["positions"], q, k, v, w["cos_sin"], state["k_cache"], state["v_cache"],
        state["slots"],
    )  # fmt: skip
    attn = paged_attention(
        q, state["k_cache"], state["v_cache"], state["table"], state["seq_lens"],
        state["query_start"], D**-0.5, max_query_len=1,
        config=AttentionConfig(16, 64, 8, num_warps=4, num_stages=2),
    )  # fmt: skip
    o = skinny_gemm(attn.view(T, HQ * D), w["o"], w["cfg"])
    h2 = rms_norm(o, w["norm2"], 1e-6, residual=residual)
    return skinny_gemm(silu_and_mul(skinny_gemm(h2, w["gate_up"], w["cfg"])), w["down"], w["cfg"])


def _inputs(gen, T, blocks, dev, dt):
    table = torch.randperm(blocks, generator=gen).to(dev).view(T, -1)[:, : (CTX + 1) // BLOCK + 1]
    pos = torch.full((T,), CTX, device=dev)
    slots = (table[:, CTX // BLOCK] * BLOCK + CTX % BLOCK).to(torch.int64)
    return {
        "x": torch.randn(T, HIDDEN, generator=gen).to(dev, dt),
        "residual": torch.randn(T, HIDDEN, generator=gen).to(dev, dt),
        "positions": pos,
        "slots": slots,
        "table": table.to(torch.int32).contiguous(),
        "seq_lens": torch.full((T,), CTX + 1, device=dev, dtype=torch.int32),
        "query_start": torch.arange(T + 1, device=dev, dtype=torch.int32),
        "k_cache": torch.randn(blocks, BLOCK, HKV, D, generator=gen).to(dev, dt),
        "v_cache": torch.randn(blocks, BLOCK, HKV, D, generator=gen).to(dev, dt),
    }


def _copy_into(dst, src):
    for name, t in src.items():
        dst[name].copy_(t)


@pytest.mark.parametrize(
    "T,cfg",
    # (the skinny GEMM's dot form, and at one row its one-row form; both prefetch their
    # weights into L2 under PDL)
    [(4, SkinnyConfig(32, 128, 4, 3)), (1, SkinnyConfig(4, 1024, 4, 1))],
)
def test_a_graph_of_pdl_launches_equals_plain_launches(monkeypatch, T, cfg):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(4096).float()[:, None] * inv[None, :]
    w = {
        "norm1": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dev, dt),
        "norm2": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dev, dt),
        "qkv": (0.02 * torch.randn((HQ + 2 * HKV) * D, HIDDEN, generator=gen)).to(dev, dt),
        "o": (0.02 * torch.randn(HIDDEN, HQ * D, generator=gen)).to(dev, dt),
        "gate_up": (0.02 * torch.randn(2 * INTER, HIDDEN, generator=gen)).to(dev, dt),
        "down": (0.02 * torch.randn(HIDDEN, INTER, generator=gen)).to(dev, dt),
        "cos_sin": torch.cat([ang.cos(), ang.sin()], dim=1).to(dev),
        "cfg": cfg,
    }
    blocks = T * 64
    cases = [_inputs(gen, T, blocks, dev, dt) for _ in range(3)]

    monkeypatch.setattr(pdl, "_enabled", False)
    want = []
    for case in cases:
        state = {name: t.clone() for name, t in case.items()}
        out = _layer(state, w)
        want.append((out.clone(), state["residual"].clone(), state["k_cache"].clone()))

    monkeypatch.setattr(pdl, "_enabled", True)
    assert pdl.options(w["qkv"]) == {"PDL": True, "launch_pdl": True}
    state = {name: t.clone() for name, t in cases[0].items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer(state, w)  # (compiles the PDL variants outside the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(state, w)
    for case, (out_want, res_want, cache_want) in zip(cases, want, strict=True):
        _copy_into(state, case)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, out_want)
        assert torch.equal(state["residual"], res_want)
        assert torch.equal(state["k_cache"], cache_want)
