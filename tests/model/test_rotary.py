"""Rotary tables against transformers' functions and against the published formulas."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from asyncllm.model.layers.rotary import dynamic_ntk_base, get_rope, rope_parameters

HEAD, MAXPOS = 64, 2048


def _hf_inv_freq(rope: dict, seq_len=None, max_pos=MAXPOS):
    cfg = LlamaConfig(
        hidden_size=HEAD * 4,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters=rope,
    )
    if rope["rope_type"] == "default":  # transformers inlines it in each model
        theta = rope["rope_theta"]
        return 1.0 / theta ** (torch.arange(0, HEAD, 2, dtype=torch.int64).float() / HEAD), 1.0
    fn = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    return fn(cfg, "cpu", seq_len=seq_len) if seq_len else fn(cfg, "cpu")


def _table_inv_freq(emb):
    """Recover inverse frequencies from the table's row for position 1 (cos is cos(θ))."""
    half = emb.rotary_dim // 2
    cos1, sin1 = emb.cos_sin_cache[1, :half], emb.cos_sin_cache[1, half:]
    return torch.atan2(sin1, cos1)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_table_matches_transformers(rope):
    emb = get_rope(HEAD, MAXPOS, rope)
    inv_freq, scale = _hf_inv_freq(rope)
    pos = torch.arange(emb.max_position, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    want = torch.cat([freqs.cos(), freqs.sin()], -1) * scale
    assert emb.cos_sin_cache.shape == want.shape
    assert torch.allclose(emb.cos_sin_cache, want, atol=1e-6, rtol=0)


def test_dynamic_ntk_follows_its_formula_at_the_longest_length():
    factor, dim, base = 4.0, HEAD, 10000.0
    emb = get_rope(HEAD, MAXPOS, {"rope_type": "dynamic", "rope_theta": base, "factor": factor})
    longest = int(MAXPOS * factor)
    assert emb.max_position == longest
    # NTK-aware scaling: base' = base * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))
    new_base = base * (factor * longest / MAXPOS - (factor - 1)) ** (dim / (dim - 2))
    want = 1.0 / new_base ** (torch.arange(0, dim, 2).double() / dim)
    assert torch.allclose(_table_inv_freq(emb).double(), want, rtol=1e-5, atol=0)
    # transformers computes the same base when it has seen `longest` tokens...
    hf, _ = _hf_inv_freq(
        {"rope_type": "dynamic", "rope_theta": base, "factor": factor}, seq_len=longest
    )
    assert torch.allclose(_table_inv_freq(emb), hf, rtol=1e-5)
    # ...and leaves short sequences unscaled, which is why the tables are fixed here.
    assert dynamic_ntk_base(base, dim, factor, MAXPOS, 100) == base


def test_yarn_follows_its_formula():
    factor, orig, base, dim = 8.0, 512, 10000.0, HEAD
    emb = get_rope(
        HEAD,
        MAXPOS,
        {
            "rope_type": "yarn",
            "rope_theta": base,
            "factor": factor,
            "original_max_position_embeddings": orig,
        },
    )
    assert emb.max_position == max(MAXPOS, orig * int(factor))
    mscale = 0.1 * math.log(factor) + 1.0
    assert math.isclose(float(emb.cos_sin_cache[0, 0]), mscale, rel_tol=1e-6)  # cos(0) * mscale
    plain = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    got = _table_inv_freq(emb)
    wavelen = 2 * math.pi / plain
    # Dimensions that turn more than beta_fast (32) times within the original context
    # keep their frequency; those turning less than beta_slow (1) times are interpolated.
    fast = orig / wavelen > 32
    slow = orig / wavelen < 1
    assert fast.any() and slow.any()
    assert torch.allclose(got[fast], plain[fast], rtol=1e-5)
    assert torch.allclose(got[slow], plain[slow] / factor, rtol=1e-5)


def test_neox_and_gptj_layouts_are_the_same_rotation_of_permuted_pairs():
    params = {"rope_type": "default", "rope_theta": 10000.0}
    neox, gptj = get_rope(HEAD, 128, params, True), get_rope(HEAD, 128, params, False)
    pos = torch.tensor([0, 3, 77])
    x = torch.randn(3, 2, HEAD)
    # GPT-J pairs (2i, 2i+1); NeoX pairs (i, i + d/2).
    perm = torch.cat([torch.arange(0, HEAD, 2), torch.arange(1, HEAD, 2)])
    q_neox, _ = neox(pos, x[..., perm], x[..., perm])
    q_gptj, _ = gptj(pos, x, x)
    assert torch.allclose(q_gptj[..., perm], q_neox, atol=1e-6)


def test_partial_rotary_leaves_the_rest_alone():
    emb = get_rope(
        HEAD, 64, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    )
    x = torch.randn(2, 1, HEAD)
    q, _ = emb(torch.tensor([5, 9]), x, x)
    assert torch.equal(q[..., HEAD // 2 :], x[..., HEAD // 2 :])
    assert not torch.allclose(q[..., : HEAD // 2], x[..., : HEAD // 2])


def test_old_style_rope_scaling_config_is_read():
    class Old:
        rope_theta = 5e5
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_parameters(Old()) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}


def test_unknown_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported rope_type 'weird'"):
        get_rope(HEAD, 64, {"rope_type": "weird", "rope_theta": 1.0})
