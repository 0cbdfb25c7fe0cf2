"""Multi-head latent attention (MLA: DeepSeek-V2/V3) over a paged latent cache.

An MLA layer caches, per token, one vector shared by its heads: the normalised KV latent
(`kv_lora_rank` = L values) followed by the rotated rotary key (`qk_rope_head_dim` = R
values). Its keys and values are up-projections of the latent by `kv_b_proj`, per head:
`k_nope = W_UK[h] c` (`qk_nope_head_dim` values, the rotary part appended) and
`v = W_UV[h] c` (`v_head_dim` values).

Two ways to attend, mathematically the same:
- **decode, absorbed**: the query's no-rotary part is projected into the latent space
  (`q_nope W_UK[h]`), so the query meets the cached vectors themselves (L + R dims, the
  first L of them the values); the latent output is projected back by `W_UV[h]`. Nothing
  is up-projected, and the cache is read once for every head (`mla_decode`).
- **prefill, up-projected**: a prefill chunk's context is read from the cache and
  up-projected into per-head keys and values, then attended as ordinary attention with
  the chunk's causal mask (head size `qk_nope_head_dim + R` for q and k).

A step's one-token chunks (decodes) take the first way, longer chunks the second. The
backend entries (`registry.py`) declare `LATENT_ATTENTION` and the latent layout
(blocks, block_size, L + R); an engine serving an MLA model must use one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from asyncllm.model.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
    numpy_to_device,
)
from asyncllm_kernels.reference import mla_decode_ref


@dataclass(frozen=True)
class MLALayerSpec:
    """One MLA layer's shape (this rank's heads) and softmax scale."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float

    @property
    def cache_size(self) -> int:
        """Values cached per token: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class MLAMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token (negative: not written)
    block_table: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S] (device)
    block_size: int
    # Every chunk has at most one token, token i belonging to sequence i (a decode
    # batch, padded or not): the decode path runs over the whole batch.
    decode_only: bool
    decode_tokens: torch.Tensor | None  # a mixed batch: the one-token chunks' tokens
    decode_seqs: torch.Tensor | None  # and their sequences
    # A mixed batch's longer chunks: (sequence, first token, query length, sequence length).
    prefills: list[tuple[int, int, int, int]]


class MLABackend(AttentionBackend):
    """MLA in plain torch (the reference, any device): the decode path through
    `reference.mla_decode_ref`, the cache written by indexing. Subclasses replace
    `write_cache` and `decode_latent` with kernels."""

    name = "torch_mla"

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """(num_blocks, block_size, head_size): one latent vector per token."""
        return (num_blocks, block_size, head_size)

    def build_metadata(self, common: CommonAttentionMetadata, block_size: int) -> MLAMetadata:
        qsl = common.query_start_loc_cpu
        lens = np.diff(qsl)
        decode_only = bool((lens <= 1).all())
        decode_tokens = decode_seqs = None
        prefills: list[tuple[int, int, int, int]] = []
        if not decode_only:
            dev = common.seq_lens.device
            ones = np.flatnonzero(lens == 1)
            if len(ones):
                decode_seqs = numpy_to_device(ones.astype(np.int64), dev)
                decode_tokens = numpy_to_device(qsl[ones].astype(np.int64), dev)
            for s in np.flatnonzero(lens > 1):
                prefills.append((int(s), int(qsl[s]), int(lens[s]), int(common.seq_lens_cpu[s])))
        return MLAMetadata(
            slot_mapping=common.slot_mapping,
            block_table=common.block_table,
            seq_lens=common.seq_lens,
            block_size=block_size,
            decode_only=decode_only,
            decode_tokens=decode_tokens,
            decode_seqs=decode_seqs,
            prefills=prefills,
        )

    def forward(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
    ) -> torch.Tensor:
        raise TypeError(
            f"attention backend {self.name!r} serves latent-attention (MLA) layers only "
            "(forward_mla)"
        )

    # -- what a kernel backend replaces -------------------------------------------------

    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Each token's [latent, rotary key] into its slot (a negative slot: not written)."""
        keep = slots >= 0
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        flat[slots[keep].long()] = torch.cat([kv_c, k_pe], dim=-1)[keep].to(flat.dtype)

    def decode_latent(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        spec: MLALayerSpec,
    ) -> torch.Tensor:
        """[n, H, L]: latent attention of n one-token queries [n, H, L + R]."""
        return mla_decode_ref(q, kv_cache, block_table, seq_lens, spec.scale, spec.kv_lora_rank)

    # -- the layer's attention ------------------------------------------------------------

    def forward_mla(
        self,
        spec: MLALayerSpec,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        md: MLAMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Attention output [T, H, v_head_dim] of T tokens: q_nope [T, H, N] and q_pe
        [T, H, R] (rotated), the step's latents kv_c [T, L] and rotary keys k_pe [T, R]
        (written to the cache first); w_uk [H, N, L] and w_uv [H, V, L] are the layer's
        `kv_b_proj` per head."""
        T = q_nope.shape[0]
        n = md.slot_mapping.shape[0]
        self.write_cache(kv_c[:n], k_pe[:n], kv_cache, md.slot_mapping)
        if md.decode_only:
            return self._decode(spec, q_nope, q_pe, kv_cache, md.block_table[:T],
                                md.seq_lens[:T], w_uk, w_uv)  # fmt: skip
        out = q_nope.new_zeros(T, spec.num_heads, spec.v_head_dim)
        if md.decode_tokens is not None and md.decode_seqs is not None:
            rows = md.decode_tokens
            out[rows] = self._decode(
                spec,
                q_nope[rows],
                q_pe[rows],
                kv_cache,
                md.block_table[md.decode_seqs],
                md.seq_lens[md.decode_seqs],
                w_uk,
                w_uv,
            )
        for seq, first, qlen, seq_len in md.prefills:
            chunk = slice(first, first + qlen)
            out[chunk] = self._prefill(
                spec, q_nope[chunk], q_pe[chunk], kv_cache, md, seq, seq_len, w_uk, w_uv
            )
        return out

    def _decode(
        self,
        spec: MLALayerSpec,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """The absorbed path (the module docstring)."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, L]
        q = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)
        latent = self.decode_latent(q, kv_cache, block_table, seq_lens, spec)  # [n, H, L]
        return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(
        self,
        spec: MLALayerSpec,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        md: MLAMetadata,
        seq: int,
        seq_len: int,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """The up-projected path for one chunk of `q_nope.shape[0]` tokens ending the
        sequence's first `seq_len` tokens (the module docstring). Up to CONTEXT_CHUNK
        tokens are up-projected at once; a longer sequence is attended one key chunk
        at a time and the chunks merged by their log-sum-exp, so the memory a step takes
        does not grow with the context."""
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1).transpose(0, 1)  # [H, q, N+R]
        if seq_len <= CONTEXT_CHUNK:
            k, v = self._up_project(spec, kv_cache, md, seq, 0, seq_len, w_uk, w_uv)
            return _causal_attention(q, k, v, spec).transpose(0, 1)  # [q, H, V]
        qlen = q.shape[1]
        out = q.new_zeros(spec.num_heads, qlen, spec.v_head_dim, dtype=torch.float32)
        lse = q.new_full((spec.num_heads, qlen), float("-inf"), dtype=torch.float32)
        query_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        for start in range(0, seq_len, CONTEXT_CHUNK):
            end = min(start + CONTEXT_CHUNK, seq_len)
            k, v = self._up_project(spec, kv_cache, md, seq, start, end, w_uk, w_uv)
            step = max(1, SCORE_ELEMENTS // (spec.num_heads * (end - start)))
            for q0 in range(0, qlen, step):  # (at most SCORE_ELEMENTS scores at a time)
                rows = slice(q0, min(q0 + step, qlen))
                scores = torch.matmul(q[:, rows], k.transpose(1, 2)).float() * spec.scale
                key_pos = torch.arange(start, end, device=q.device)
                scores.masked_fill_(key_pos[None, None, :] > query_pos[rows, None], float("-inf"))
                part_lse = torch.logsumexp(scores, dim=-1)  # [H, rows]
                seen = torch.isfinite(part_lse)  # (a query before this chunk sees none of it)
                probs = torch.exp(scores - torch.where(seen, part_lse, 0.0)[..., None])
                part = torch.matmul(probs.to(v.dtype), v).float()
                new_lse = torch.logaddexp(lse[:, rows], part_lse)
                keep = torch.exp(lse[:, rows] - new_lse).nan_to_num(0.0)
                add = torch.exp(part_lse - new_lse).nan_to_num(0.0)
                out[:, rows] = out[:, rows] * keep[..., None] + part * add[..., None]
                lse[:, rows] = new_lse
        return out.to(q.dtype).transpose(0, 1)

    def _up_project(
        self,
        spec: MLALayerSpec,
        kv_cache: torch.Tensor,
        md: MLAMetadata,
        seq: int,
        start: int,
        end: int,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [H, n, N+R] and values [H, n, V] of the sequence's tokens [start, end)
        from the latent cache."""
        bs = md.block_size
        blocks = md.block_table[seq, start // bs : -(-end // bs)].long()
        first = start - (start // bs) * bs
        cached = kv_cache[blocks].reshape(-1, spec.cache_size)[first : first + end - start]
        c, k_rope = cached.to(w_uk.dtype).split([spec.kv_lora_rank, spec.qk_rope_head_dim], -1)
        k_nope = torch.einsum("kl,hdl->hkd", c, w_uk)  # [H, n, N]
        v = torch.einsum("kl,hdl->hkd", c, w_uv)  # [H, n, V]
        k = torch.cat([k_nope, k_rope.unsqueeze(0).expand(spec.num_heads, -1, -1)], dim=-1)
        return k, v


CONTEXT_CHUNK = 8192  # tokens up-projected at once in a prefill chunk's attention
SCORE_ELEMENTS = 1 << 25  # float32 scores held at once past CONTEXT_CHUNK (128 MiB)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MLALayerSpec
) -> torch.Tensor:
    """[H, q, V]: the q queries are the last of the keys' sequence, causal."""
    qlen, seq_len = q.shape[1], k.shape[1]
    # (equal head sizes for q/k and v let every SDPA kernel take it)
    pad = q.shape[-1] - spec.v_head_dim
    v = F.pad(v, (0, pad)) if pad > 0 else v
    q4, k4, v4 = q[None], k[None], v[None]  # (the fused SDPA kernels want 4-D inputs)
    if qlen == seq_len:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=spec.scale)
    else:
        mask = causal_lower_right(qlen, seq_len)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=spec.scale)
    return out[0, ..., : spec.v_head_dim]
