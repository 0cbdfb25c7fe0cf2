"""Rotary position embedding with the scaling kinds the supported models use.

The cos/sin table is computed once for every position up to the model's limit, so a
step only gathers rows by position (no per-step recomputation, graph friendly).
Kinds: default, linear, dynamic (NTK-aware, fixed at the scaled maximum length),
llama3 and yarn. Layouts: NeoX (rotate halves) and GPT-J (rotate interleaved pairs).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from asyncllm.model.layers.norm import RMSNorm
from asyncllm_kernels.reference import apply_rotary_ref


def base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def llama3_inv_freq(base: float, rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between."""
    inv_freq = base_inv_freq(base, rotary_dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def dynamic_ntk_base(
    base: float, rotary_dim: int, factor: float, max_position: int, seq_len: int
) -> float:
    """NTK-aware base for a sequence of `seq_len` tokens (no change up to `max_position`)."""
    seq_len = max(seq_len, max_position)
    return base * ((factor * seq_len / max_position) - (factor - 1)) ** (
        rotary_dim / (rotary_dim - 2)
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    base: float, rotary_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between.

    Returns the inverse frequencies and the factor that scales cos and sin.
    """
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / orig
    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = (
            yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
            if m and m_all
            else yarn_mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


def uses_kernels(t: torch.Tensor) -> bool:
    """Whether the rotation runs as the Triton launch for tensors like `t` (on CUDA; a
    CPU test may make it so under Triton's interpreter), else as its torch reference."""
    return t.is_cuda


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]: cos, then sin

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        with torch.device("cpu"):
            t = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq.float().cpu())
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
        # Kept in float32 whatever the model dtype: the rotation is computed in float32.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[nn.Module, nn.Module] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq * D] or [T, Hq, D]; k likewise. Returns them rotated, same shapes
        (on CUDA rotated in place by one Triton kernel; elsewhere new tensors, from the
        kernel's plain-torch reference). `norms`: q's and k's per-head norms (Qwen3's
        q_norm, k_norm), applied first; on CUDA in the rotation's launch where both are
        plain RMSNorms and the rotation covers whole heads."""
        cuda = uses_kernels(q) and q.stride(-1) == 1 and k.stride(-1) == 1
        q, k, weights = self._norms_first(q, k, norms, cuda)
        q3 = q.view(q.shape[0], -1, self.head_size)
        k3 = k.view(k.shape[0], -1, self.head_size)
        if cuda:
            from asyncllm_kernels.rotary import apply_rotary_

            apply_rotary_(positions, q3, k3, self.cos_sin_cache, self.is_neox_style, *weights)
            return q, k
        q3 = apply_rotary_ref(positions, q3, self.cos_sin_cache, self.is_neox_style)
        k3 = apply_rotary_ref(positions, k3, self.cos_sin_cache, self.is_neox_style)
        return q3.reshape(q.shape), k3.reshape(k.shape)

    def into_kv_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        norms: tuple[nn.Module, nn.Module] | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor | None:
        """`forward` for q, [T, Hq, D]; k rotated and v, [T, Hk, D], written straight into
        the (2, blocks, block_size, Hk, D) `kv_cache` at `slot_mapping` in the same launch
        (k itself is then not rotated). Returns q, or None where that launch cannot do
        it (off CUDA, partial rotary, strided heads): the caller then runs `forward` and
        the backend's own cache write."""
        if not (
            uses_kernels(q)
            and self.rotary_dim == self.head_size
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        ):
            return None
        from asyncllm_kernels.rotary import rotate_into_kv_cache_

        q, k, weights = self._norms_first(q, k, norms, True)
        rotate_into_kv_cache_(
            positions, q, k, v, self.cos_sin_cache, kv_cache[0], kv_cache[1], slot_mapping,
            self.is_neox_style, *weights,
        )  # fmt: skip
        return q

    def _norms_first(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[nn.Module, nn.Module] | None,
        cuda: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, float]]:
        """q and k with the per-head norms applied here unless the rotation's launch
        applies them (on CUDA, plain RMSNorms over whole heads), and that launch's
        (norm weights or None, eps)."""
        if norms is None:
            return q, k, (None, 0.0)
        if cuda and self._fuses(norms):
            qn, kn = cast(RMSNorm, norms[0]), cast(RMSNorm, norms[1])
            return q, k, ((qn.weight, kn.weight), qn.eps)
        return norms[0](q), norms[1](k), (None, 0.0)

    def _fuses(self, norms: tuple[nn.Module, nn.Module]) -> bool:
        qn, kn = norms
        return (
            type(qn) is RMSNorm
            and type(kn) is RMSNorm
            and qn.eps == kn.eps
            and self.rotary_dim == self.head_size
        )


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings in one dict (`rope_parameters`, or older `rope_scaling` + `rope_theta`).

    Where they differ by layer type (Gemma 3: `{"sliding_attention": {...},
    "full_attention": {...}}`), those of `layer_type` (default: full attention)."""
    params = getattr(config, "rope_parameters", None)
    if params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params[layer_type or "full_attention"])
    elif params and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def get_rope(
    head_size: int,
    max_position: int,
    params: dict[str, Any],
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """The rotary embedding for a config's parameters; tables are computed on the CPU."""
    with torch.device("cpu"):
        return _build_rope(head_size, max_position, params, is_neox_style)


def _build_rope(
    head_size: int, max_position: int, params: dict[str, Any], is_neox_style: bool
) -> RotaryEmbedding:
    base = float(params["rope_theta"])
    rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", "default")
    scaling = 1.0
    if kind == "default":
        inv_freq = base_inv_freq(base, rotary_dim)
    elif kind == "linear":
        inv_freq = base_inv_freq(base, rotary_dim) / params["factor"]
    elif kind == "dynamic":
        factor = params["factor"]
        longest = int(max_position * factor)
        inv_freq = base_inv_freq(
            dynamic_ntk_base(base, rotary_dim, factor, max_position, longest), rotary_dim
        )
        max_position = longest
    elif kind == "llama3":
        inv_freq = llama3_inv_freq(base, rotary_dim, params)
    elif kind == "yarn":
        inv_freq, scaling = yarn_inv_freq(base, rotary_dim, params, max_position)
        orig = params["original_max_position_embeddings"]
        max_position = max(max_position, int(orig * (params.get("factor") or 1)))
    else:
        raise ValueError(
            f"unsupported rope_type {kind!r} (supported: default, linear, dynamic, llama3, yarn)"
        )
    return RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq, scaling, is_neox_style)
