"""Runs one scheduled step: updates the persistent batch, builds inputs with numpy,
runs the model, computes logits only where needed, samples.

Logits are computed for each request's last scheduled token when that token ends
what is known of the request (a finished prefill or a decode), and for every prompt
position of requests that asked for prompt logprobs. One LM-head matmul covers both.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.config import EngineConfig
from asyncllm.model.attention.backend import AttentionBackend, CommonAttentionMetadata
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.loader import load_model
from asyncllm.sample.logits_processor import LogitsProcessor, load_logits_processor_class
from asyncllm.sample.ops import bincount_rows
from asyncllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from asyncllm.worker.input_batch import CachedRequestState, InputBatch

_SEED_MIX = 0x9E3779B97F4A7C15


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request at its n-th output token: a function of
    (seed, n) only, so draws do not depend on batch mates or on preemptions."""
    return (seed * _SEED_MIX + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def select_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """Triton kernels on CUDA, plain torch elsewhere (and on request, as the reference)."""
    if name is None:
        name = "triton" if device.type == "cuda" else "torch_native"
    if name == "torch_native":
        return TorchNativeBackend()
    if device.type != "cuda":
        raise ValueError(f"attention_backend 'triton' needs a CUDA device, got {device}")
    from asyncllm.model.attention.triton_attn import TritonAttentionBackend  # imports triton

    return TritonAttentionBackend()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.dtype = mc.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = mc.max_model_len
        self.backend = select_attention_backend(self.device, config.attention_backend)
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs,
            self.max_model_len,
            -(-self.max_model_len // self.block_size),
        )
        self.vocab_size = int(mc.hf_config.vocab_size)
        self.processors: list[LogitsProcessor] = [
            load_logits_processor_class(path)(self.vocab_size, self.device)
            for path in config.logits_processors
        ]
        self.sampler = Sampler(self.processors)
        self.model = None
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.backend)

    def kv_cache_block_bytes(self) -> int:
        attn = self.model.model.layers[0].self_attn
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        return per_layer * self.model.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        attn = self.model.model.layers[0].self_attn
        shape = self.backend.kv_cache_shape(
            num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.model.num_layers)
        ]

    # -- the step ------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids:
            state = batch.remove(rid)
            if state is not None:
                for p in self.processors:
                    p.remove_request(state.row)
        for new in so.scheduled_new_reqs:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device)
            state = batch.add(
                dict(
                    req_id=new.req_id,
                    prompt_token_ids=list(new.prompt_token_ids),
                    output_token_ids=list(new.output_token_ids),
                    sampling_params=new.sampling_params,
                    generator=gen,
                    eos_token_id=new.eos_token_id,
                ),
                new.block_ids,
                new.num_computed_tokens,
            )
            for p in self.processors:
                p.add_request(
                    state.row, new.sampling_params, state.prompt_token_ids, state.output_token_ids
                )
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.requests[rid].row
            if blocks:
                batch.append_blocks(row, blocks)
            batch.num_computed_tokens[row] = computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={})
        states = [batch.requests[r] for r in req_ids]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        n = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=len(req_ids)
        )
        qsl = np.zeros(len(n) + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        tok_req = np.repeat(np.arange(len(n)), n)
        pos = computed[tok_req] + (np.arange(qsl[-1]) - qsl[:-1][tok_req])
        tok_rows = rows[tok_req]
        input_ids = batch.token_ids[tok_rows, pos]
        bs = self.block_size
        slots = batch.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (computed + n).astype(np.int32)
        width = int(-(-seq_lens.max() // bs))
        common = CommonAttentionMetadata.from_numpy(
            qsl, seq_lens, batch.block_table[rows, :width], slots, self.device
        )
        md = self.backend.build_metadata(common, bs)
        hidden = self.model(
            torch.from_numpy(input_ids).to(self.device, non_blocking=True),
            torch.from_numpy(pos).to(self.device, non_blocking=True),
            self.kv_caches,
            md,
        )

        # Which rows need logits.
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        samples = np.nonzero(seq_lens >= num_tokens)[0]
        sample_rows = qsl[1:][samples] - 1
        prompt_lp: list[tuple[int, np.ndarray, np.ndarray]] = []  # (batch idx, rows, targets)
        for i, s in enumerate(states):
            if s.sampling_params.prompt_logprobs is None or s.output_token_ids:
                continue  # (resumed after preemption: its prompt logprobs went out already)
            p_len = len(s.prompt_token_ids)
            start, end = int(computed[i]), int(min(seq_lens[i], p_len - 1))
            if end > start:
                prompt_lp.append(
                    (
                        i,
                        np.arange(qsl[i], qsl[i] + end - start),
                        batch.token_ids[s.row, start + 1 : end + 1],
                    )
                )
        wanted = [sample_rows] + [r for _, r, _ in prompt_lp]
        logit_rows = np.concatenate(wanted) if wanted else sample_rows
        logits = self.model.compute_logits(
            hidden.index_select(0, torch.from_numpy(logit_rows).to(self.device))
        ).float()

        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids={})
        sampled_states = [states[i] for i in samples]
        if len(samples):
            smd = self._sampling_metadata(sampled_states)
            result = self.sampler(logits[: len(samples)], smd)
            tokens = result.token_ids.tolist()
            if result.logprobs is not None:
                ids, lps, ranks = (
                    result.logprob_token_ids.tolist(),
                    result.logprobs.tolist(),
                    result.ranks.tolist(),
                )
            for k, (state, token) in enumerate(zip(sampled_states, tokens)):
                out.sampled_token_ids[state.req_id] = [token]
                want = state.sampling_params.logprobs
                if want is not None:
                    out.logprobs[state.req_id] = TokenLogprobs(
                        [ids[k][: 1 + want]], [lps[k][: 1 + want]], [ranks[k]]
                    )
                batch.append_token(state, token)
        offset = len(samples)
        for i, r, targets in prompt_lp:
            chunk = logits[offset : offset + len(r)]
            offset += len(r)
            want = states[i].sampling_params.prompt_logprobs
            t_ids, t_lps, t_ranks = gather_logprobs(
                chunk.log_softmax(-1), torch.from_numpy(targets).to(self.device), want
            )
            out.prompt_logprobs[states[i].req_id] = TokenLogprobs(
                t_ids.tolist(), t_lps.tolist(), t_ranks.tolist()
            )
        batch.num_computed_tokens[rows] = seq_lens
        return out

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        dev, V = self.device, self.vocab_size
        params = [s.sampling_params for s in states]
        greedy = [p.is_greedy for p in params]
        md = SamplingMetadata(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)], device=dev
            ),
            is_greedy=torch.tensor(greedy, device=dev),
            all_greedy=all(greedy),
            rows=[s.row for s in states],
        )
        random = [not g for g in greedy]
        if any(p.top_k > 0 for p, r in zip(params, random) if r):
            md.top_k = torch.tensor([p.top_k for p in params], device=dev)
        if any(p.top_p < 1 for p, r in zip(params, random) if r):
            md.top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0 for p, r in zip(params, random) if r):
            md.min_p = torch.tensor([p.min_p for p in params], device=dev)
        for i, (s, r) in enumerate(zip(states, random)):
            if r and s.generator is not None:
                s.generator.manual_seed(step_seed(s.sampling_params.seed, len(s.output_token_ids)))
                md.generators[i] = s.generator
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = (
                bincount_rows([s.prompt_token_ids + s.output_token_ids for s in states], V, dev) > 0
            )
            md.seen_mask = seen
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            md.output_counts = bincount_rows([s.output_token_ids for s in states], V, dev)
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
        if any(p.logit_bias for p in params):
            bias = torch.zeros(len(states), V)
            for i, p in enumerate(params):
                for tok, b in (p.logit_bias or {}).items():
                    bias[i, tok] = b
            md.logit_bias = bias.to(dev)
        for i, (s, p) in enumerate(zip(states, params)):
            if len(s.output_token_ids) < p.min_tokens:
                blocked = list(p.stop_token_ids)
                if s.eos_token_id is not None and not p.ignore_eos:
                    blocked.append(s.eos_token_id)
                if blocked:
                    md.blocked_tokens.append((i, blocked))
        want = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(want) if want else None
        return md
