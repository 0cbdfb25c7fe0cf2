"""Paged attention in plain PyTorch: runs on any device, and is the reference.

Per step, the builder turns the batch into padded gathers shared by every layer:
each sequence's keys are gathered from its blocks into [num_seqs, max_seq_len], its
queries into [num_seqs, max_query_len], with one boolean mask covering causality
within the chunk, each sequence's length and the optional sliding window. K/V go
into the cache through the cache-write kernel's plain-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncllm.model.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)
from asyncllm_kernels.reference import reshape_and_cache_ref


@dataclass
class TorchNativeMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token (negative: not written)
    key_blocks: torch.Tensor  # [S, Lk / block_size] block of each key position (0: padding)
    query_rows: torch.Tensor  # [T] row of each token in the padded [S * Lq] queries
    query_pos: torch.Tensor  # [S, Lq] absolute position of each padded query
    key_pos: torch.Tensor  # [Lk]
    seq_lens: torch.Tensor  # [S]
    num_seqs: int
    max_query_len: int
    mask: torch.Tensor  # [S, 1, Lq, Lk] causal within the chunk and inside each sequence
    windowed_masks: dict[int, torch.Tensor]  # sliding window -> mask, made on first use

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.mask
        mask = self.windowed_masks.get(sliding_window)
        if mask is None:
            qpos, kpos = self.query_pos[:, None, :, None], self.key_pos[None, None, None, :]
            mask = _keep_rows_finite(self.mask & (kpos > qpos - sliding_window))
            self.windowed_masks[sliding_window] = mask
        return mask


def _keep_rows_finite(mask: torch.Tensor) -> torch.Tensor:
    """Padded query rows see nothing; let them see key 0 so softmax stays finite."""
    mask[..., 0] |= ~mask.any(dim=-1)
    return mask


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def build_metadata(
        self, common: CommonAttentionMetadata, block_size: int
    ) -> TorchNativeMetadata:
        device = common.block_table.device
        S, Lq = common.num_seqs, max(common.max_query_len, 1)
        n_blocks = -(-max(common.max_seq_len, 1) // block_size)
        Lk = n_blocks * block_size  # keys are gathered whole blocks at a time
        qsl = common.query_start_loc.long()
        seq_lens = common.seq_lens.long()
        query_lens = qsl[1:] - qsl[:-1]
        n = common.num_actual_tokens
        token_seq = torch.repeat_interleave(torch.arange(S, device=device), query_lens)
        token_off = torch.arange(n, device=device) - qsl[:-1][token_seq]
        query_rows = token_seq * Lq + token_off

        key_pos = torch.arange(Lk, device=device)
        blocks = common.block_table.long()
        if blocks.shape[1] < n_blocks:
            blocks = F.pad(blocks, (0, n_blocks - blocks.shape[1]))
        key_blocks = blocks[:, :n_blocks]

        context = seq_lens - query_lens
        query_pos = context[:, None] + torch.arange(Lq, device=device)[None, :]
        kp, qp = key_pos[None, None, :], query_pos[:, :, None]
        mask = (kp <= qp) & (kp < seq_lens[:, None, None])
        return TorchNativeMetadata(
            slot_mapping=common.slot_mapping[:n].long(),
            key_blocks=key_blocks,
            query_rows=query_rows,
            query_pos=query_pos,
            key_pos=key_pos,
            seq_lens=seq_lens,
            num_seqs=S,
            max_query_len=Lq,
            mask=_keep_rows_finite(mask[:, None]),
            windowed_masks={},
        )

    def forward(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchNativeMetadata,
    ) -> torch.Tensor:
        md = metadata
        T = md.query_rows.shape[0]
        reshape_and_cache_ref(k[:T], v[:T], kv_cache[0], kv_cache[1], md.slot_mapping)
        S, Lq, Hq, Hkv, D = (
            md.num_seqs,
            md.max_query_len,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
        )
        qp = q.new_zeros(S * Lq, Hq, D)
        qp.index_copy_(0, md.query_rows, q[:T])
        qp = qp.view(S, Lq, Hq, D).transpose(1, 2)  # [S, Hq, Lq, D]
        Lk = md.key_pos.shape[0]
        keys = kv_cache[0][md.key_blocks].view(S, Lk, Hkv, D).to(q.dtype)  # whole blocks
        vals = kv_cache[1][md.key_blocks].view(S, Lk, Hkv, D).to(q.dtype)
        keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)  # [S, Hkv, Lk, D]
        mask = md.mask_for(spec.sliding_window)

        if spec.logits_soft_cap is None:
            out = F.scaled_dot_product_attention(
                qp, keys, vals, attn_mask=mask, scale=spec.scale, enable_gqa=Hq != Hkv
            )
        else:
            keys = keys.repeat_interleave(Hq // Hkv, dim=1)
            vals = vals.repeat_interleave(Hq // Hkv, dim=1)
            scores = torch.matmul(qp, keys.transpose(-1, -2)).float() * spec.scale
            cap = spec.logits_soft_cap
            scores = torch.tanh(scores / cap) * cap
            scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(scores.softmax(dim=-1).to(vals.dtype), vals)
        out = out.transpose(1, 2).reshape(S * Lq, Hq, D).index_select(0, md.query_rows)
        if q.shape[0] > T:  # padding tokens (a padded decode batch): zeros
            out = torch.cat([out, out.new_zeros(q.shape[0] - T, Hq, D)])
        return out
