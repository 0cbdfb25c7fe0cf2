"""A small runner for a model over a paged KV cache: the demo and model tests use it.

It owns the per-layer caches and a free list of blocks, and feeds any mix of chunks
(prefill pieces and single decode tokens, for several sequences) through the model
in one flat batch. Sequences can share full prefix blocks (copy-free forks), as the
prefix cache does. The engine's scheduler-driven model runner supersedes it for
serving; this stays the simplest way to drive a model by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from asyncllm.model.attention.backend import AttentionBackend, CommonAttentionMetadata
from asyncllm.model.interface import CausalLM


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose K/V are in the cache


class PagedDecoder:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int = 16,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.model, self.backend, self.block_size = model, backend, block_size
        spec = model.kv_cache_spec()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(spec.num_layers)
        ]
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def add_sequence(self, share_prefix_of: int | None = None, num_shared_tokens: int = 0) -> int:
        """A new sequence, optionally starting on another's first full blocks."""
        seq = _Sequence()
        if share_prefix_of is not None:
            if num_shared_tokens % self.block_size:
                raise ValueError("only whole blocks can be shared")
            src = self.seqs[share_prefix_of]
            if num_shared_tokens > src.num_tokens:
                raise ValueError("cannot share more tokens than the source sequence has cached")
            seq.blocks = src.blocks[: num_shared_tokens // self.block_size]
            for b in seq.blocks:
                self.ref_counts[b] += 1
            seq.num_tokens = num_shared_tokens
        sid, self._next_id = self._next_id, self._next_id + 1
        self.seqs[sid] = seq
        return sid

    def free(self, sid: int) -> None:
        for b in self.seqs.pop(sid).blocks:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    def _grow(self, seq: _Sequence, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free_blocks)} free")
        for _ in range(need):
            b = self.free_blocks.pop()
            self.ref_counts[b] = 1
            seq.blocks.append(b)

    @torch.inference_mode()
    def step(
        self, chunks: dict[int, list[int]], all_logits: bool = False
    ) -> dict[int, torch.Tensor]:
        """Runs one flat batch; returns float32 logits per sequence (last token, or all)."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for sid, tokens in chunks.items():
            if not tokens:
                raise ValueError(f"sequence {sid}: empty chunk")
            seq = self.seqs[sid]
            self._grow(seq, seq.num_tokens + len(tokens))
            ids.extend(tokens)
            positions.extend(range(seq.num_tokens, seq.num_tokens + len(tokens)))
            query_lens.append(len(tokens))
            seq_lens.append(seq.num_tokens + len(tokens))
            tables.append(seq.blocks)
        common = CommonAttentionMetadata.from_lists(
            query_lens, seq_lens, tables, self.block_size, self.device
        )
        md = self.backend.build_metadata(common, self.block_size)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, self.kv_caches, md)
        ends = common.query_start_loc_cpu
        # One LM-head matmul for every row wanted (the head's weight is read once).
        if all_logits:
            rows = torch.arange(len(ids), device=self.device)
        else:
            rows = torch.as_tensor(ends[1:] - 1, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
        out = {}
        for i, sid in enumerate(chunks):
            out[sid] = logits[ends[i] : ends[i + 1]] if all_logits else logits[i : i + 1]
            self.seqs[sid].num_tokens = seq_lens[i]
        return out

    def generate_greedy(
        self,
        prompt: list[int],
        max_tokens: int,
        stop_ids: tuple[int, ...] = (),
        chunk_size: int | None = None,
    ) -> Iterator[int]:
        """Yields greedy tokens one by one; frees the sequence when done or closed."""
        sid = self.add_sequence()
        try:
            step = chunk_size or len(prompt)
            for start in range(0, len(prompt), step):
                logits = self.step({sid: prompt[start : start + step]})[sid]
            for _ in range(max_tokens):
                token = int(logits[-1].argmax())
                yield token
                if token in stop_ids:
                    return
                logits = self.step({sid: [token]})[sid]
        finally:
            self.free(sid)
