"""Runs one scheduled step: updates the persistent batch, builds inputs with numpy,
runs the model, computes logits only where needed, samples.

Logits are computed for each request's last scheduled token when that token ends
what is known of the request (a finished prefill or a decode), and for every prompt
position of requests that asked for prompt logprobs. One LM-head matmul covers both.

A bad value in one request never fails the step: each new request is checked (and its
per-request state built) on its own, and one that cannot be taken is dropped from the
batch and reported in `ModelRunnerOutput.failed`; if building the batch's sampling
state or sampling still fails, each request is retried alone, and only those that fail
alone are reported. An error no request can be blamed for propagates (the engine dies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncllm.config import EngineConfig
from asyncllm.model.attention.backend import AttentionBackend, CommonAttentionMetadata
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.interface import CausalLM
from asyncllm.model.loader import load_model
from asyncllm.sample.logits_processor import LogitsProcessor, load_logits_processor_class
from asyncllm.sample.ops import bincount_rows
from asyncllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from asyncllm.worker.input_batch import CachedRequestState, InputBatch

logger = logging.getLogger(__name__)

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


@dataclass
class StepInputs:
    """One step's batch, gathered from the persistent batch with numpy: S requests in
    the scheduler's order, T tokens back to back."""

    states: list[CachedRequestState]  # [S]
    rows: np.ndarray  # [S] persistent-batch row of each request
    query_start_loc: np.ndarray  # [S + 1] int32: offset of each request's chunk
    num_computed: np.ndarray  # [S] int64: tokens in the cache before this step
    seq_lens: np.ndarray  # [S] int32: tokens in the cache after this step
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    attn_metadata: Any  # the backend's, built once and shared by every layer


@dataclass
class PromptLogprobRows:
    """One request's prompt positions in this step whose next-token logprobs go out."""

    req_id: str
    num_logprobs: int  # top-n besides the prompt token
    rows: np.ndarray  # rows of the step's hidden states
    targets: np.ndarray  # the prompt token that follows each row


@dataclass
class LogitRows:
    """Rows of the step's hidden states that get logits, in the order of `rows`: first
    the last token of each sampling request, then each request's prompt-logprob rows."""

    samples: np.ndarray  # batch indices (into StepInputs.states) of the requests that sample
    prompt: list[PromptLogprobRows]
    rows: np.ndarray


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
        self.model: CausalLM | None = None  # set by load_model, dropped at shutdown
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.backend)

    def _loaded_model(self) -> CausalLM:
        if self.model is None:
            raise RuntimeError("the model is not loaded: call load_model() first")
        return self.model

    def kv_cache_block_bytes(self) -> int:
        return self._loaded_model().kv_cache_spec().block_bytes(self.block_size, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        spec = self._loaded_model().kv_cache_spec()
        shape = self.backend.kv_cache_shape(
            num_blocks, self.block_size, spec.num_kv_heads, spec.head_size
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(spec.num_layers)
        ]

    # -- the step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        failed = self._update_states(so)
        scheduled = so.num_scheduled_tokens
        if failed:  # (the scheduler's own dict stays as it was)
            scheduled = {rid: n for rid, n in scheduled.items() if rid not in failed}
        if not scheduled:
            return ModelRunnerOutput(sampled_token_ids={}, failed=failed)
        inputs = self._prepare_inputs(scheduled)
        hidden = self._run_model(inputs)
        # Picked before sampling appends tokens: whether a request samples, and whether it
        # still owes prompt logprobs, depend on the tokens it had when the step began.
        picks = self._pick_logit_rows(inputs)
        logits = self._compute_logits(hidden, picks)
        sampled, logprobs, sample_failed = self._sample(inputs, picks, logits)
        prompt_logprobs = self._prompt_logprobs(picks, logits)
        self.input_batch.num_computed_tokens[inputs.rows] = inputs.seq_lens  # now cached
        for rid in sample_failed:
            self._drop(rid)
            prompt_logprobs.pop(rid, None)
        failed.update(sample_failed)
        return ModelRunnerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed=failed,
        )

    def _drop(self, req_id: str) -> None:
        """Takes a request out of the persistent batch and the logits processors."""
        state = self.input_batch.remove(req_id)
        if state is not None:
            for p in self.processors:
                p.remove_request(state.row)

    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Brings the persistent batch up to date: drops finished (or preempted)
        requests, adds new (or resumed) ones, appends new blocks and progress. Returns
        the new requests that could not be added (request id -> why), which are not in
        the batch."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self._drop(rid)
        failed: dict[str, str] = {}
        for new in so.scheduled_new_reqs:
            try:
                self._add_request(new)
            except Exception as e:  # noqa: BLE001 (this request's fault: it fails alone)
                logger.warning("request %r failed in the model runner: %s", new.req_id, e)
                failed[new.req_id] = f"the model runner could not take it: {type(e).__name__}: {e}"
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.requests[rid].row
            if blocks:
                batch.append_blocks(row, blocks)
            batch.num_computed_tokens[row] = computed
        return failed

    def _add_request(self, new: NewRequestData) -> None:
        """Adds a new (or resumed) request to the persistent batch and the logits
        processors; raises, leaving no trace of it, if anything of it is bad."""
        self._check_new_request(new)
        gen = None
        if new.sampling_params.seed is not None:
            gen = torch.Generator(device=self.device)
        state = self.input_batch.add(
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
        added: list[LogitsProcessor] = []
        try:
            for p in self.processors:
                p.add_request(
                    state.row, new.sampling_params, state.prompt_token_ids, state.output_token_ids
                )
                added.append(p)
        except BaseException:
            self.input_batch.remove(new.req_id)
            for p in added:
                p.remove_request(state.row)
            raise

    def _check_new_request(self, new: NewRequestData) -> None:
        """Everything of one request that would fail a whole step if it were bad (a
        token id the embedding or a logits index cannot take, a number no tensor can
        hold, more logprobs than the vocabulary): the frontend and the core check all
        this before, but a request that skipped them must fail alone."""
        params = new.sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params is a {type(params).__name__}")
        params.verify()  # types and ranges: every number fits its tensor
        vocab = self.vocab_size
        tokens = new.prompt_token_ids + new.output_token_ids
        if not tokens:
            raise ValueError("it has no tokens")
        if not all(type(t) is int for t in tokens) or min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"its token ids must be ints in [0, {vocab})")
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or {}),
        ):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} has a token id outside [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > vocab:
                raise ValueError(f"{name} is {v}, more than the {vocab} tokens there are")
        if not 0 <= new.num_computed_tokens <= len(tokens):
            raise ValueError(f"num_computed_tokens {new.num_computed_tokens} is out of range")

    def _prepare_inputs(self, scheduled: dict[str, int]) -> StepInputs:
        """The step's flat batch (`scheduled`: request id -> tokens, in batch order) with
        vectorised gathers from the persistent arrays (no per-token Python), and the
        attention metadata every layer shares."""
        batch = self.input_batch
        states = [batch.requests[r] for r in scheduled]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        n = np.fromiter(scheduled.values(), dtype=np.int32, count=len(states))
        qsl = np.zeros(len(n) + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        tok_req = np.repeat(np.arange(len(n)), n)  # each token's request
        pos = computed[tok_req] + (np.arange(qsl[-1]) - qsl[:-1][tok_req])
        tok_rows = rows[tok_req]
        bs = self.block_size
        slots = batch.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (computed + n).astype(np.int32)
        width = int(-(-seq_lens.max() // bs))  # block-table columns the longest one needs
        common = CommonAttentionMetadata.from_numpy(
            qsl, seq_lens, batch.block_table[rows, :width], slots, self.device
        )
        return StepInputs(
            states=states,
            rows=rows,
            query_start_loc=qsl,
            num_computed=computed,
            seq_lens=seq_lens,
            input_ids=batch.token_ids[tok_rows, pos],
            positions=pos,
            attn_metadata=self.backend.build_metadata(common, bs),
        )

    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, hidden]; writes the step's K/V into the cache."""
        return self._loaded_model()(
            torch.from_numpy(inputs.input_ids).to(self.device, non_blocking=True),
            torch.from_numpy(inputs.positions).to(self.device, non_blocking=True),
            self.kv_caches,
            inputs.attn_metadata,
        )

    def _pick_logit_rows(self, inputs: StepInputs) -> LogitRows:
        """A request samples when this step reaches the end of what is known of it (a
        finished prefill, or a decode); a partial prefill chunk does not. A request that
        asked for prompt logprobs gets them for the prompt positions of its chunk (each
        predicts the next prompt token), unless it is resuming after a preemption."""
        states, qsl = inputs.states, inputs.query_start_loc
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        samples = np.nonzero(inputs.seq_lens >= num_tokens)[0]
        sample_rows = qsl[1:][samples] - 1
        prompt: list[PromptLogprobRows] = []
        for i, s in enumerate(states):
            want = s.sampling_params.prompt_logprobs
            if want is None or s.output_token_ids:
                continue  # (resumed after preemption: its prompt logprobs went out already)
            p_len = len(s.prompt_token_ids)
            start, end = int(inputs.num_computed[i]), int(min(inputs.seq_lens[i], p_len - 1))
            if end > start:
                prompt.append(
                    PromptLogprobRows(
                        s.req_id,
                        want,
                        np.arange(qsl[i], qsl[i] + end - start),
                        self.input_batch.token_ids[s.row, start + 1 : end + 1],
                    )
                )
        rows = np.concatenate([sample_rows] + [p.rows for p in prompt])
        return LogitRows(samples, prompt, rows)

    def _compute_logits(self, hidden: torch.Tensor, picks: LogitRows) -> torch.Tensor:
        """Float32 logits of the picked rows only: one LM-head matmul covers sampling and
        prompt logprobs, and rows nobody reads are never projected."""
        rows = torch.from_numpy(picks.rows).to(self.device)
        return self._loaded_model().compute_logits(hidden.index_select(0, rows)).float()

    def _sample(
        self, inputs: StepInputs, picks: LogitRows, logits: torch.Tensor
    ) -> tuple[dict[str, list[int]], dict[str, TokenLogprobs], dict[str, str]]:
        """One token per sampling request (the first rows of `logits`), appended to the
        persistent batch; with its logprobs where asked. If the batch cannot be sampled,
        each request is sampled alone: those that fail alone are returned (request id ->
        why) and get nothing; if all of them fail, the error is the step's and is raised."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        failed: dict[str, str] = {}
        if not len(picks.samples):
            return sampled, logprobs, failed
        states = [inputs.states[i] for i in picks.samples]
        try:
            results = [(states, self._sample_rows(states, logits[: len(states)]))]
        except Exception as batch_error:
            results = []
            for k, state in enumerate(states):
                try:
                    results.append(([state], self._sample_rows([state], logits[k : k + 1].clone())))
                except Exception as e:  # noqa: BLE001 (tried alone: this request's fault)
                    failed[state.req_id] = f"sampling failed: {type(e).__name__}: {e}"
            if not results:
                raise batch_error
            logger.warning("requests failed in sampling, the rest of the batch went on: %s", failed)
        for group, (tokens, top) in results:
            for k, (state, token) in enumerate(zip(group, tokens)):
                sampled[state.req_id] = [token]
                want = state.sampling_params.logprobs
                if want is not None:
                    assert top is not None  # the sampler computes them when any row wants them
                    ids, lps, ranks = top
                    logprobs[state.req_id] = TokenLogprobs(
                        [ids[k][: 1 + want]], [lps[k][: 1 + want]], [ranks[k]]
                    )
                self.input_batch.append_token(state, token)
        return sampled, logprobs, failed

    def _sample_rows(
        self, states: list[CachedRequestState], logits: torch.Tensor
    ) -> tuple[list[int], tuple[list, list, list] | None]:
        """Samples one token for each of `states` (row i of `logits`): the tokens, and
        (ids, logprobs, ranks) lists if any of them wants logprobs."""
        result = self.sampler(logits, self._sampling_metadata(states))
        tokens = result.token_ids.tolist()
        top = None
        if result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.ranks is not None
            top = (
                result.logprob_token_ids.tolist(),
                result.logprobs.tolist(),
                result.ranks.tolist(),
            )
        return tokens, top

    def _prompt_logprobs(self, picks: LogitRows, logits: torch.Tensor) -> dict[str, TokenLogprobs]:
        """Per request, the logprob and rank of each next prompt token, with the top-n."""
        out: dict[str, TokenLogprobs] = {}
        offset = len(picks.samples)
        for p in picks.prompt:
            chunk = logits[offset : offset + len(p.rows)]
            offset += len(p.rows)
            ids, lps, ranks = gather_logprobs(
                chunk.log_softmax(-1), torch.from_numpy(p.targets).to(self.device), p.num_logprobs
            )
            out[p.req_id] = TokenLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
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
            seed = s.sampling_params.seed
            if r and s.generator is not None and seed is not None:
                s.generator.manual_seed(step_seed(seed, len(s.output_token_ids)))
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
                blocked = list(p.stop_token_ids or ())
                if s.eos_token_id is not None and not p.ignore_eos and 0 <= s.eos_token_id < V:
                    blocked.append(s.eos_token_id)  # (an id past the vocabulary is never drawn)
                if blocked:
                    md.blocked_tokens.append((i, blocked))
        want = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(want) if want else None
        return md
