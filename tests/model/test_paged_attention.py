"""Paged attention semantics: chunked prefill, shared prefix blocks, mixed batches, GQA."""

from __future__ import annotations

import math

import pytest
import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.loader import load_model
from tests.model.paged_decoder import PagedDecoder
from tests.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama3", folder)
    cfg = create_model_config(EngineArgs(model=str(folder), device="cpu"))
    return load_model(cfg, TorchNativeBackend())


@pytest.fixture(params=["smollm", "tiny"])
def model(request, tiny_llama):
    if request.param == "tiny":
        return tiny_llama
    return request.getfixturevalue("smollm_model")


def _prompt(model, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()


def test_chunked_prefill_equals_one_pass(model):
    prompt = _prompt(model, 300)
    dec = PagedDecoder(model, TorchNativeBackend(), num_blocks=64)
    whole = dec.add_sequence()
    one_pass = dec.step({whole: prompt}, all_logits=True)[whole]
    chunked = dec.add_sequence()
    parts, start = [], 0
    for size in (37, 141, 122):
        parts.append(dec.step({chunked: prompt[start : start + size]}, all_logits=True)[chunked])
        start += size
    diff = (torch.cat(parts) - one_pass).abs().max().item()
    assert diff <= 1e-3, diff


def test_shared_prefix_blocks_give_the_logits_of_a_lone_sequence(model):
    prefix = _prompt(model, 96, seed=1)  # six full blocks
    tail_a, tail_b = _prompt(model, 20, seed=2), _prompt(model, 45, seed=3)
    dec = PagedDecoder(model, TorchNativeBackend(), num_blocks=64)

    alone = {}
    for name, tail in (("a", tail_a), ("b", tail_b)):
        sid = dec.add_sequence()
        alone[name] = dec.step({sid: prefix + tail}, all_logits=True)[sid][len(prefix) :]
        dec.free(sid)
    assert dec.num_free_blocks == 64

    owner = dec.add_sequence()
    dec.step({owner: prefix})
    used = 64 - dec.num_free_blocks
    a = dec.add_sequence(share_prefix_of=owner, num_shared_tokens=96)
    b = dec.add_sequence(share_prefix_of=owner, num_shared_tokens=96)
    both = dec.step({a: tail_a, b: tail_b}, all_logits=True)  # one batch, shared blocks
    assert (both[a] - alone["a"]).abs().max().item() <= 1e-3
    assert (both[b] - alone["b"]).abs().max().item() <= 1e-3
    # Sharing cost no blocks for the prefix: only the tails' blocks were taken.
    assert 64 - dec.num_free_blocks == used + math.ceil(20 / 16) + math.ceil(45 / 16)
    for sid in (a, b, owner):
        dec.free(sid)
    assert dec.num_free_blocks == 64


def test_mixed_batch_of_prefill_chunks_and_decodes_equals_separate_runs(model):
    p0 = _prompt(model, 5, seed=10)
    p1, p2 = _prompt(model, 40, seed=11), _prompt(model, 130, seed=12)
    decodes = _prompt(model, 2, seed=13)
    dec = PagedDecoder(model, TorchNativeBackend(), num_blocks=64)
    solo = []
    for tokens in (p0 + decodes, p1, p2):
        sid = dec.add_sequence()
        solo.append(dec.step({sid: tokens}, all_logits=True)[sid])
        dec.free(sid)

    s0, s1, s2 = dec.add_sequence(), dec.add_sequence(), dec.add_sequence()
    got0 = [dec.step({s0: p0}, all_logits=True)[s0]]
    # Two steps in which sequence 0 decodes one token while 1 and 2 prefill in chunks.
    out = dec.step({s0: decodes[:1], s1: p1[:23], s2: p2[:64]}, all_logits=True)
    got0.append(out[s0]), (got1 := [out[s1]]), (got2 := [out[s2]])
    out = dec.step({s1: p1[23:], s0: decodes[1:], s2: p2[64:]}, all_logits=True)
    got0.append(out[s0]), got1.append(out[s1]), got2.append(out[s2])
    for got, want in zip((got0, got1, got2), solo):
        assert (torch.cat(got) - want).abs().max().item() <= 1e-3


def _reference_attention(q, k, v, scale, window=None, soft_cap=None):
    """Plain causal attention for one sequence whose chunk ends the sequence."""
    Lq, Lk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    qpos = torch.arange(Lk - Lq, Lk)[:, None]
    kpos = torch.arange(Lk)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 30.0)])
def test_backend_against_plain_attention(group, window, soft_cap):
    gen = torch.Generator().manual_seed(group)
    Hkv, D, bs = 2, 16, 16
    spec = AttentionLayerSpec(Hkv * group, Hkv, D, D**-0.5, window, soft_cap)
    be = TorchNativeBackend()
    cache = torch.zeros(be.kv_cache_shape(32, bs, Hkv, D))
    seqs = [(1, 40), (17, 17), (9, 70), (1, 1)]  # (query len, total len)
    full = [
        (torch.randn(n, Hkv, D, generator=gen), torch.randn(n, Hkv, D, generator=gen))
        for _, n in seqs
    ]
    perm = torch.randperm(32, generator=gen).tolist()  # scattered blocks
    tables, used = [], 0
    for _, n in seqs:
        nb = -(-n // bs)
        tables.append(perm[used : used + nb])
        used += nb
    # Earlier tokens are already cached: write them with a first "prefill" step.
    ctx = [n - q for q, n in seqs]
    pre = [(c, c, t) for c, t in zip(ctx, tables) if c > 0]
    md0 = CommonAttentionMetadata.from_lists(
        [p[0] for p in pre], [p[1] for p in pre], [p[2] for p in pre], bs, "cpu"
    )
    k0 = torch.cat([full[i][0][:c] for i, c in enumerate(ctx) if c > 0])
    v0 = torch.cat([full[i][1][:c] for i, c in enumerate(ctx) if c > 0])
    be.forward(
        spec, torch.zeros(len(k0), spec.num_heads, D), k0, v0, cache, be.build_metadata(md0, bs)
    )

    md = CommonAttentionMetadata.from_lists(
        [q for q, _ in seqs], [n for _, n in seqs], tables, bs, "cpu"
    )
    qs = [torch.randn(q, spec.num_heads, D, generator=gen) for q, _ in seqs]
    k1 = torch.cat([full[i][0][c:] for i, c in enumerate(ctx)])
    v1 = torch.cat([full[i][1][c:] for i, c in enumerate(ctx)])
    out = be.forward(spec, torch.cat(qs), k1, v1, cache, be.build_metadata(md, bs))
    want = torch.cat(
        [_reference_attention(q, k, v, spec.scale, window, soft_cap) for q, (k, v) in zip(qs, full)]
    )
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def test_negative_slots_are_not_written():
    be = TorchNativeBackend()
    cache = torch.zeros(be.kv_cache_shape(4, 16, 1, 8))
    md = CommonAttentionMetadata.from_lists([2], [2], [[1]], 16, "cpu")
    md.slot_mapping[1] = -1
    k = torch.ones(2, 1, 8)
    be.forward(
        AttentionLayerSpec(1, 1, 8, 1.0),
        torch.ones(2, 1, 8),
        k,
        k,
        cache,
        be.build_metadata(md, 16),
    )
    assert cache[0, 1, 0].eq(1).all() and cache[0, 1, 1].eq(0).all()
    assert cache.sum() == 2 * 8
