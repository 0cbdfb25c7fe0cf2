"""Runs one scheduled step: updates the persistent batch, fills the step buffers with
numpy, runs the model (a CUDA-graph replay for decode steps that fit a captured size,
eager otherwise), computes logits only where needed, samples.

Logits are computed for each request's last scheduled token when that token ends
what is known of the request (a finished prefill or a decode), and, in chunks of
`PROMPT_LOGPROB_CHUNK` rows, for every prompt position of requests that asked for
prompt logprobs.

Per step nothing allocates a tensor from a Python list: inputs go through the
preallocated `StepBuffers`, sampling parameters and penalty state live per row on the
device (`SamplingState`), and the sampled ids come back in one device-to-host copy.

Async scheduling: `execute_model_async` queues the step and returns a `StepResult`
before its tokens are known; the next step may be launched before `result()` is
called. The sampled ids also stay on the device, by persistent row (`last_sampled`),
and a decode whose input token is still being sampled by the step in flight gets it
there by a device-side scatter (`InputBatch.num_pending` counts such tokens). Results
are applied to the persistent batch in launch order, each once, and only to requests
still in it (a row may have changed hands meanwhile). User logits processors read the
requests' output ids, so a step with processors applies the results in flight before
sampling (after its forward is queued).

A bad value in one request never fails the step: each new request is checked (and its
per-request state built) on its own, and one that cannot be taken is dropped from the
batch and reported in `ModelRunnerOutput.failed`; if sampling still fails, each
request is retried alone, and only those that fail alone are reported. An error no
request can be blamed for propagates (the engine dies).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncllm.config import EngineConfig
from asyncllm.model.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    numpy_to_device,
)
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.interface import CausalLM
from asyncllm.model.loader import load_model
from asyncllm.sample import ops
from asyncllm.sample.logits_processor import LogitsProcessor, load_logits_processor_class
from asyncllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import (
    GrammarSync,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from asyncllm.worker.cuda_graph import DecodeGraphs
from asyncllm.worker.grammar_handshake import GrammarHandshake
from asyncllm.worker.input_batch import CachedRequestState, InputBatch
from asyncllm.worker.mask_staging import MaskStaging
from asyncllm.worker.sampling_state import SamplingState
from asyncllm.worker.step_buffers import StepBuffers, padded_size

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_CHUNK = 512  # rows of prompt-logprob logits computed at once


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
    """One step's batch: S requests in the scheduler's order, T tokens back to back, in
    the runner's step buffers (padded to `graph_size` tokens and sequences when the step
    replays a CUDA graph)."""

    states: list[CachedRequestState]  # [S]
    rows: np.ndarray  # [S] persistent-batch row of each request
    query_start_loc: np.ndarray  # [S + 1] int32: offset of each request's chunk
    num_computed: np.ndarray  # [S] int32: tokens in the cache before this step
    seq_lens: np.ndarray  # [S] int32: tokens in the cache after this step
    num_tokens: int  # T
    samples: np.ndarray  # indices (into states) of the requests that sample
    graph_size: int | None  # the captured batch size this decode step replays, if any


@dataclass
class PromptLogprobRows:
    """One request's prompt positions in this step whose next-token logprobs go out."""

    req_id: str
    num_logprobs: int  # top-n besides the prompt token
    rows: np.ndarray  # rows of the step's hidden states
    targets: np.ndarray  # the prompt token that follows each row


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.dtype = mc.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = mc.max_model_len
        self.backend = select_attention_backend(self.device, config.attention_backend)
        sched = config.scheduler
        max_blocks = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(sched.max_num_seqs, self.max_model_len, max_blocks)
        self.vocab_size = int(mc.hf_config.vocab_size)
        # Decode batches up to the largest captured size are padded to a captured size
        # (and replayed as a graph on CUDA once captured).
        self.capture_sizes = sorted(config.cudagraph_capture_sizes)
        self.buffers = StepBuffers(
            max(sched.max_num_batched_tokens, self.capture_sizes[-1] if self.capture_sizes else 0),
            sched.max_num_seqs,
            max_blocks,
            self.device,
        )
        self.sampling = SamplingState(sched.max_num_seqs, self.vocab_size, self.device)
        self.processors: list[LogitsProcessor] = [
            load_logits_processor_class(path)(self.vocab_size, self.device)
            for path in config.logits_processors
        ]
        self.sampler = Sampler(self.processors)
        self.model: CausalLM | None = None  # set by load_model, dropped at shutdown
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.graph_logits: torch.Tensor | None = None  # [largest size, vocab] float32
        # Each persistent row's last sampled token, on the device (async scheduling); the
        # row past the last holds -1 (a device step's token for a request not held).
        self.last_sampled = torch.zeros(
            sched.max_num_seqs + 1, dtype=torch.int64, device=self.device
        )
        self.last_sampled[-1] = -1
        self._in_flight: deque[StepResult] = deque()  # launched, results not applied
        self._mask_staging: MaskStaging | None = None  # (CUDA, at the first grammar mask)
        self._handshake: GrammarHandshake | None = None  # (CUDA, at the first device step)

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.backend)

    def _loaded_model(self) -> CausalLM:
        if self.model is None:
            raise RuntimeError("the model is not loaded: call load_model() first")
        return self.model

    def kv_cache_block_bytes(self) -> int:
        return self._loaded_model().kv_cache_spec().block_bytes(self.block_size, self.dtype)

    def _kv_cache_tensors(self, num_blocks: int) -> list[torch.Tensor]:
        spec = self._loaded_model().kv_cache_spec()
        shape = self.backend.kv_cache_shape(
            num_blocks, self.block_size, spec.num_kv_heads, spec.head_size
        )
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(spec.num_layers)
        ]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._kv_cache_tensors(num_blocks)

    # -- start-up: memory profile and graph capture ----------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Runs a step at the largest shapes, so the caller can read the peak memory:
        the forward of `max_num_batched_tokens` tokens (sequences of at most
        `max_model_len`), sampling `max_num_seqs` rows with every transform on, and one
        prompt-logprob chunk. The KV cache is one scratch block per layer, never written
        (every slot is -1); the penalty state and the graphs' logits buffer are
        allocated here for good, so they count as used before the KV cache is sized."""
        sched = self.config.scheduler
        T = sched.max_num_batched_tokens
        lens = [min(self.max_model_len, T - i) for i in range(0, T, self.max_model_len)]
        lens = lens[: sched.max_num_seqs]
        T = sum(lens)
        S = len(lens)
        buf = self.buffers
        qsl = buf.query_start_loc.np
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1 : S + 1])
        buf.seq_lens.np[:S] = lens
        buf.block_table.np[:S] = 0
        buf.input_ids.np[:T] = 0
        buf.positions.np[:T] = np.concatenate([np.arange(n) for n in lens])
        buf.slot_mapping.np[:T] = -1
        buf.copy_to_device(S)
        scratch = self._kv_cache_tensors(1)
        model = self._loaded_model()
        hidden = model(
            buf.input_ids.device[:T], buf.positions.device[:T], scratch, self._metadata(T, S)
        )
        B = min(sched.max_num_seqs, T)
        logits = model.compute_logits(hidden[:B]).float()
        self.sampling.allocate_penalty_state()
        Sampler()(logits, self._worst_case_metadata(B))  # (user processors: not profiled)
        del logits
        chunk = hidden[: min(PROMPT_LOGPROB_CHUNK, T)]
        lp = model.compute_logits(chunk).float().log_softmax(-1)
        gather_logprobs(lp, torch.zeros(len(chunk), dtype=torch.int64, device=self.device), 20)
        del lp, hidden, scratch
        if self.capture_sizes and self.device.type == "cuda" and self.graph_logits is None:
            shape = (self.capture_sizes[-1], self.vocab_size)
            self.graph_logits = torch.empty(shape, dtype=torch.float32, device=self.device)

    def _worst_case_metadata(self, B: int) -> SamplingMetadata:
        dev, V = self.device, self.vocab_size
        counts = torch.zeros(B, V, dtype=torch.int32, device=dev)
        return SamplingMetadata(
            temperature=torch.full((B,), 0.7, device=dev),
            is_greedy=torch.zeros(B, dtype=torch.bool, device=dev),
            all_greedy=False,
            top_k=torch.full((B,), 50, dtype=torch.int64, device=dev),
            top_p=torch.full((B,), 0.9, device=dev),
            min_p=torch.full((B,), 0.05, device=dev),
            repetition_penalty=torch.full((B,), 1.1, device=dev),
            seen_mask=counts > 0,
            presence_penalty=torch.full((B,), 0.1, device=dev),
            frequency_penalty=torch.full((B,), 0.1, device=dev),
            output_counts=counts,
            max_num_logprobs=self.config.max_logprobs,
        )

    @torch.inference_mode()
    def profile_decode_graph(self) -> None:
        """An eager decode step at the largest capture size, for the caller to read the
        peak of: what the graphs' memory pool will hold."""
        if self.capture_sizes:
            size = self.capture_sizes[-1]
            scratch = self._kv_cache_tensors(1)
            self._inert_decode_batch(size)
            model = self._loaded_model()
            hidden = model(
                self.buffers.input_ids.device[:size],
                self.buffers.positions.device[:size],
                scratch,
                self._metadata(size, size),
            )
            model.compute_logits(hidden).float()

    @torch.inference_mode()
    def warm_up_mixed_steps(self) -> int:
        """Eager forwards of inert batches that mix one-token decodes with a prefill
        chunk, one per attention launch shape such a step can meet (on CUDA, with the
        Triton backend): the kernels that serve only mixed steps are compiled here, at
        start-up, not in the first step that mixes a new prompt into running decodes
        (~2.7 s on an H200 with a cold Triton cache). Returns the number of batches run."""
        if self.device.type != "cuda" or self.backend.name != "triton":
            return 0
        sizes = self.mixed_warm_up_sizes()
        for num_seqs in sizes:
            self.run_inert_mixed_batch(num_seqs)
        return len(sizes)

    def mixed_warm_up_sizes(self) -> list[int]:
        """One batch size (sequences) per decode-launch config of the Triton backend's
        mixed steps (the prefill launch's config does not depend on the batch)."""
        from asyncllm_kernels.paged_attention import choose_config

        spec = self._loaded_model().kv_cache_spec()
        hf = self.config.model.hf_config
        group = hf.num_attention_heads // getattr(hf, "num_key_value_heads", hf.num_attention_heads)
        sched = self.config.scheduler
        largest = min(sched.max_num_seqs, sched.max_num_batched_tokens - 1)
        shapes: dict[Any, int] = {}  # decode launch config -> the first batch size with it
        for num_seqs in range(2, largest + 1):
            cfg = choose_config(
                num_seqs, spec.num_kv_heads, group, spec.head_size, True, self.device, self.dtype
            )
            shapes.setdefault(cfg, num_seqs)
        return list(shapes.values())

    @torch.inference_mode()
    def run_inert_mixed_batch(self, num_seqs: int) -> None:
        """One eager forward of `num_seqs - 1` one-token decodes and a two-token prefill
        chunk that writes nothing to the KV cache (every slot is -1)."""
        T = self._inert_mixed_batch(num_seqs)
        self._loaded_model()(
            self.buffers.input_ids.device[:T],
            self.buffers.positions.device[:T],
            self.kv_caches,
            self._metadata(T, num_seqs),
        )

    def _inert_mixed_batch(self, num_seqs: int) -> int:
        """run_inert_mixed_batch's batch in the step buffers; returns its tokens."""
        lens = np.ones(num_seqs, dtype=np.int64)
        lens[-1] = 2
        return self._inert_batch(lens)

    def _inert_decode_batch(self, size: int) -> None:
        """A decode batch of `size` one-token sequences that writes nothing."""
        self._inert_batch(np.ones(size, dtype=np.int64))

    def _inert_batch(self, lens: np.ndarray) -> int:
        """Sequences of `lens` tokens (no context) in the step buffers that write nothing
        to the KV cache (every slot -1); returns the token count."""
        buf, S = self.buffers, len(lens)
        T = int(lens.sum())
        buf.query_start_loc.np[0] = 0
        np.cumsum(lens, out=buf.query_start_loc.np[1 : S + 1])
        buf.seq_lens.np[:S] = lens
        buf.block_table.np[:S] = 0
        buf.input_ids.np[:T] = 0
        buf.positions.np[:T] = 0
        buf.slot_mapping.np[:T] = -1
        buf.copy_to_device(S)
        return T

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> DecodeGraphs | None:
        """Captures the decode graphs (after the KV cache exists: they bake in its
        addresses). Nothing is written to the cache, and no random stream is used."""
        if not self.capture_sizes or self.device.type != "cuda":
            return None
        if self.graph_logits is None:
            raise RuntimeError("profile_run() allocates the graphs' logits: run it first")
        model, out = self._loaded_model(), self.graph_logits

        def forward(size: int) -> None:
            hidden = model(
                self.buffers.input_ids.device[:size],
                self.buffers.positions.device[:size],
                self.kv_caches,
                self._metadata(size, size),
            )
            out[:size].copy_(model.compute_logits(hidden))

        self.graphs = DecodeGraphs(self.capture_sizes)
        self.graphs.capture(self._inert_decode_batch, forward)
        return self.graphs

    # -- the step ------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step and returns its results."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepResult:
        """Queues the step on the device; its `result()` waits for the tokens."""
        if self._in_flight:
            self._in_flight[-1].finish_launch()  # (its logits must be sampled first)
        result = self._launch(so)
        self._in_flight.append(result)
        return result

    def _launch(self, so: SchedulerOutput) -> StepResult:
        failed = self._update_states(so)
        batch = self.input_batch
        scheduled = so.num_scheduled_tokens
        if failed or not all(rid in batch.requests for rid in scheduled):
            # (requests the runner could not take, now or in an earlier step: the
            # scheduler ends them; its own dict stays as it was)
            scheduled = {rid: n for rid, n in scheduled.items() if rid in batch.requests}
        sync = so.grammar_sync
        if sync is not None and self._handshake is None:
            self._handshake = GrammarHandshake()
        if not scheduled:
            if sync is not None:
                self._handshake_alone(sync)
            return StepResult(self, [], failed, {}, None)
        inputs = self._prepare_inputs(scheduled, sync)
        # Picked before sampling appends tokens: whether a request still owes prompt
        # logprobs depends on the tokens it had when the step began.
        prompt_rows = self._prompt_logprob_rows(inputs)
        hidden, logits = self._run_model(inputs, prompt_rows)
        result = StepResult(self, [], failed, {}, None)
        if so.grammar_bitmask_later:
            # The forward is queued; the sampling waits for the bitmask (`finish_launch`).
            result.finish = lambda: self._finish_launch(
                so, result, inputs, prompt_rows, hidden, logits
            )
        else:
            self._finish_launch(so, result, inputs, prompt_rows, hidden, logits)
        return result

    @torch.inference_mode()
    def _finish_launch(
        self,
        so: SchedulerOutput,
        result: StepResult,
        inputs: StepInputs,
        prompt_rows: list[PromptLogprobRows],
        hidden: torch.Tensor | None,
        logits: torch.Tensor,
    ) -> None:
        """Queues the rest of a launched step: the grammar masks, the sampling, prompt
        logprobs and the copies to the host."""
        result.finish = None
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        # (queued before the masking: nothing in them waits for the host)
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_rows)
        staged = False
        if so.grammar_sync is not None:
            # (the staging's buffers first: making them may wait for the device, which
            # would then wait for this step's masks)
            if self.device.type == "cuda":
                self._staging().reserve(*so.grammar_bitmask.shape)
            assert self._handshake is not None
            if self._masks_graphed(so, inputs, logits):
                # (the usual device step: the bitmask's copy waits on the handshake's
                # stream, beside the forward; only the masking kernel waits for it)
                masks = so.grammar_bitmask
                buffer = self._staging().direct_buffer(*masks.shape)
                self._handshake.copy_when_filled(so.grammar_sync, buffer, masks)
                staged = True
            else:
                self._handshake.wait_for_masks(so.grammar_sync)
        if so.grammar_bitmask is not None and self._apply_grammar_bitmask(
            so, inputs, logits, staged
        ):
            # A copy still to run reads the scheduler's bitmask: it writes that buffer
            # again once this step's event has passed, recorded even if the rest fails.
            so.grammar_bitmask_copied = done
        try:
            groups, sample_failed = self._sample(inputs, logits, result)
            del logits
        finally:
            if done is not None:
                done.record()
        self.input_batch.num_computed_tokens[inputs.rows] = inputs.seq_lens  # now cached
        for rid in sample_failed:
            self._drop(rid)
            prompt_logprobs.pop(rid, None)
        result._failed.update(sample_failed)
        result._groups, result._prompt_logprobs = groups, prompt_logprobs
        result._done = done

    def apply_results_through(self, result: StepResult | None) -> None:
        """Applies the results in flight, oldest first, up to `result` (None: all)."""
        while self._in_flight:
            r = self._in_flight[0]
            r.apply()  # (interrupted, it stays in flight: a later call applies it)
            self._in_flight.popleft()
            if r is result:
                return

    def _apply_results_before(self, result: StepResult) -> None:
        """Applies the results in flight launched before `result` (a split step's own
        is in flight while it is sampled: applied now, it would have no tokens)."""
        while self._in_flight and self._in_flight[0] is not result:
            self._in_flight[0].apply()
            self._in_flight.popleft()

    def _drop(self, req_id: str) -> None:
        """Takes a request out of the persistent batch and the logits processors."""
        state = self.input_batch.remove(req_id)
        if state is not None:
            self._forget_row(self.processors, state.row)

    @staticmethod
    def _forget_row(processors: list[Any], row: int) -> None:
        """Each processor forgets `row`; one that raises is logged and the others still
        forget it (else their setting would pass to the row's next request, and the
        step would fail half applied)."""
        for p in processors:
            try:
                p.remove_request(row)
            except Exception:  # noqa: BLE001 (a user processor's bug: logged, not fatal)
                logger.exception("logits processor %s failed to forget row %d", p, row)

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
        requests = batch.requests
        rows, computed = [], []
        for rid, blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = requests.get(rid)
            if state is None:
                continue  # the runner could not take it in an earlier step
            if blocks:
                batch.append_blocks(state.row, blocks)
            rows.append(state.row)
            computed.append(num_computed)
        if rows:
            batch.num_computed_tokens[rows] = computed
        return failed

    def _add_request(self, new: NewRequestData) -> None:
        """Adds a new (or resumed) request to the persistent batch, its sampling row and
        the logits processors; raises, leaving no trace of it, if anything of it is bad."""
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
            self.sampling.add(
                state.row, new.sampling_params, state.prompt_token_ids, state.output_token_ids
            )
            for p in self.processors:
                p.add_request(
                    state.row, new.sampling_params, state.prompt_token_ids, state.output_token_ids
                )
                added.append(p)
        except BaseException:
            self.input_batch.remove(new.req_id)
            self._forget_row(added, state.row)
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

    def _prepare_inputs(
        self, scheduled: dict[str, int], sync: GrammarSync | None = None
    ) -> StepInputs:
        """Fills the step buffers (`scheduled`: request id -> tokens, in batch order)
        with vectorised gathers from the persistent arrays, pads a decode step to its
        captured size, and queues the copies to the device; for a device step (`sync`),
        then the tokens ahead to the grammar process (the last ones sampled for its
        requests)."""
        batch, buf = self.input_batch, self.buffers
        states = [batch.requests[r] for r in scheduled]
        S = len(states)
        buf.wait_until_writable()
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=S)
        n = np.fromiter(scheduled.values(), dtype=np.int32, count=S)
        qsl = buf.query_start_loc.np[: S + 1]
        qsl[0] = 0
        np.cumsum(n, out=qsl[1:])
        T = int(qsl[S])
        computed = batch.num_computed_tokens[rows]
        seq_lens = buf.seq_lens.np[:S]
        np.add(computed, n, out=seq_lens)
        if T == S:  # one token each: a decode step (or one-token chunks)
            tok_rows, pos = rows, computed.astype(np.int64)
        else:
            tok_req = np.repeat(np.arange(S), n)  # each token's request
            pos = computed[tok_req] + (np.arange(T) - qsl[:-1][tok_req])
            tok_rows = rows[tok_req]
        bs = self.block_size
        buf.positions.np[:T] = pos
        buf.input_ids.np[:T] = batch.token_ids[tok_rows, pos]
        # Tokens past the known ones are being sampled by the step in flight.
        pending = np.nonzero(pos >= batch.num_tokens[tok_rows])[0]
        buf.pending_at.np[: len(pending)] = pending
        buf.pending_rows.np[: len(pending)] = tok_rows[pending]
        buf.slot_mapping.np[:T] = batch.block_table[tok_rows, pos // bs] * bs + pos % bs
        np.take(batch.block_table, rows, axis=0, out=buf.block_table.np[:S])
        samples = np.nonzero(seq_lens >= batch.num_tokens[rows] + batch.num_pending[rows])[0]
        buf.sample_rows.np[: len(samples)] = rows[samples]
        buf.logit_rows.np[: len(samples)] = qsl[1:][samples] - 1
        if sync is not None:
            self._write_grammar_rows(sync)
        graph_size = None
        if T == S and len(samples) == S and self.capture_sizes:
            graph_size = padded_size(S, self.capture_sizes)
        if graph_size is not None:
            buf.pad(T, S, graph_size, graph_size)
            buf.copy_to_device(graph_size)
        else:
            buf.copy_to_device(S)
        buf.step_queued()
        if sync is not None:
            self._give_tokens_ahead(sync)
        if len(pending):
            k = len(pending)
            sampled = self.last_sampled.index_select(0, buf.pending_rows.device[:k])
            buf.input_ids.device.index_copy_(0, buf.pending_at.device[:k], sampled)
        return StepInputs(
            states=states,
            rows=rows,
            query_start_loc=qsl,
            num_computed=computed,
            seq_lens=seq_lens,
            num_tokens=T,
            samples=samples,
            graph_size=graph_size,
        )

    def _write_grammar_rows(self, sync: GrammarSync) -> int:
        """Writes the persistent rows of a device step's requests ahead to the step
        buffers (a request the runner does not hold: the row whose token is -1); their
        number."""
        none = len(self.last_sampled) - 1
        requests = self.input_batch.requests
        k = len(sync.ahead_req_ids)
        self.buffers.grammar_rows.np[:k] = [
            state.row if state is not None else none
            for state in map(requests.get, sync.ahead_req_ids)
        ]
        return k

    def _handshake_alone(self, sync: GrammarSync) -> None:
        """A device step with nothing to run still hands its tokens ahead over (with
        only their rows copied to the device) and waits for its masks: the next step's
        hand-over must not overwrite these tokens before the grammar process has read
        them."""
        buf = self.buffers
        buf.wait_until_writable()
        k = self._write_grammar_rows(sync)
        if buf.grammar_rows.device is not buf.grammar_rows.cpu:
            buf.grammar_rows.device[:k].copy_(buf.grammar_rows.cpu[:k], non_blocking=True)
        buf.step_queued()
        self._give_tokens_ahead(sync)
        assert self._handshake is not None
        self._handshake.wait_for_masks(sync)

    def _give_tokens_ahead(self, sync: GrammarSync) -> None:
        """Queues the hand-over of the last tokens sampled for a device step's requests
        ahead (their rows on the device already) to the grammar process."""
        k = len(sync.ahead_req_ids)
        rows = self.buffers.grammar_rows
        first, last = (int(rows.np[0]), int(rows.np[k - 1])) if k else (0, -1)
        in_line = last - first == k - 1 and (k < 3 or bool((np.diff(rows.np[:k]) == 1).all()))
        assert self._handshake is not None
        self._handshake.give_tokens(
            sync, self.last_sampled, rows.device[:k], first if in_line else None
        )
        sync.given = True

    def _metadata(self, T: int, S: int) -> Any:
        """The backend's attention metadata over the first T tokens and S sequences of
        the step buffers (already on the device)."""
        buf = self.buffers
        qsl = buf.query_start_loc.np[: S + 1]
        seq_lens = buf.seq_lens.np[:S]
        common = CommonAttentionMetadata(
            query_start_loc=buf.query_start_loc.device[: S + 1],
            seq_lens=buf.seq_lens.device[:S],
            block_table=buf.block_table.device[:S],
            slot_mapping=buf.slot_mapping.device[:T],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(np.diff(qsl).max()) if S else 0,
            max_seq_len=int(seq_lens.max()) if S else 0,
        )
        return self.backend.build_metadata(common, self.block_size)

    def _run_model(
        self, inputs: StepInputs, prompt_rows: list[PromptLogprobRows]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden states [T, hidden] or None after a graph replay, float32 logits of
        the sampling requests in batch order); writes the step's K/V into the cache."""
        size, S = inputs.graph_size, len(inputs.states)
        model = self._loaded_model()
        if size is not None and self.graphs is not None and not prompt_rows:
            assert self.graph_logits is not None
            self.graphs.replay(size)
            return None, self.graph_logits[:S]
        T = size or inputs.num_tokens  # padded on the CPU too, to test the padding
        hidden = model(
            self.buffers.input_ids.device[:T],
            self.buffers.positions.device[:T],
            self.kv_caches,
            self._metadata(T, size or S),
        )
        if not len(inputs.samples):
            return hidden, hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        if len(inputs.samples) == T:
            last = hidden
        else:
            last = hidden.index_select(0, self.buffers.logit_rows.device[: len(inputs.samples)])
        return hidden, model.compute_logits(last).float()[: len(inputs.samples)]

    def _prompt_logprob_rows(self, inputs: StepInputs) -> list[PromptLogprobRows]:
        """A request that asked for prompt logprobs gets them for the prompt positions
        of its chunk (each predicts the next prompt token), unless it is resuming after
        a preemption."""
        qsl = inputs.query_start_loc
        out: list[PromptLogprobRows] = []
        for i, s in enumerate(inputs.states):
            want = s.sampling_params.prompt_logprobs
            if want is None or s.output_token_ids:
                continue  # (resumed after preemption: its prompt logprobs went out already)
            p_len = len(s.prompt_token_ids)
            start, end = int(inputs.num_computed[i]), int(min(inputs.seq_lens[i], p_len - 1))
            if end > start:
                out.append(
                    PromptLogprobRows(
                        s.req_id,
                        want,
                        np.arange(qsl[i], qsl[i] + end - start),
                        self.input_batch.token_ids[s.row, start + 1 : end + 1],
                    )
                )
        return out

    @staticmethod
    def _sampled_ids(inputs: StepInputs) -> list[str]:
        states = inputs.states
        if len(inputs.samples) == len(states):
            return [s.req_id for s in states]
        return [states[i].req_id for i in inputs.samples]

    def _logits_graphed(self, logits: torch.Tensor) -> bool:
        """Whether `logits` are the decode graphs' output (an address that stays)."""
        return self.graph_logits is not None and logits.data_ptr() == self.graph_logits.data_ptr()

    def _masks_graphed(self, so: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor) -> bool:
        """Whether a device step's masks take the usual way: every constrained row
        samples, in order, and the logits are a decode graph's (its bitmask, in the
        manager's shared memory, is pinned)."""
        return (
            self.device.type == "cuda"
            and self._logits_graphed(logits)
            and self._sampled_ids(inputs) == so.structured_req_ids
        )

    def _apply_grammar_bitmask(
        self, so: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor, staged: bool = False
    ) -> bool:
        """Masks the logits of the structured-output requests that sample this step with
        their rows of the scheduler's bitmask (on the device; `staged`: the bitmask's
        copy is queued already, `copy_when_filled`); whether the bitmask is read by a
        copy still to run. Nothing here waits for the device: on CUDA the bitmask is
        pinned and copied without a sync (MaskStaging)."""
        masks = so.grammar_bitmask
        if staged:  # (`_masks_graphed` said so: the usual step, its copy queued)
            return self._staging().apply_graphed(masks, logits, copied=True)
        sampled = self._sampled_ids(inputs)
        staging = self._staging() if self.device.type == "cuda" else None
        if sampled == so.structured_req_ids:  # (the usual step: every row, in order)
            if (
                staging is not None
                and self._logits_graphed(logits)
                and staging.apply_graphed(masks, logits)
            ):
                return True  # (a decode graph's logits: masked by a graph of its own)
            logit_rows, in_order = list(range(len(sampled))), True
            mask_rows = logit_rows
        else:
            index = {rid: k for k, rid in enumerate(so.structured_req_ids)}
            logit_rows, mask_rows = [], []
            for k, rid in enumerate(sampled):
                j = index.get(rid)
                if j is not None:
                    logit_rows.append(k)
                    mask_rows.append(j)
            in_order = mask_rows == list(range(len(mask_rows)))
        if not logit_rows:
            return False
        read_later = False
        if not in_order and so.grammar_sync is not None:
            # (a device step whose masks are gathered on the host, once filled: only when
            # the runner lacks one of its constrained requests, the orders being the same)
            assert self._handshake is not None
            self._handshake.wait_on_host(so.grammar_sync)
        if staging is not None:
            rows, masks, read_later = staging.to_device(
                masks, None if in_order else mask_rows, logit_rows
            )
        else:
            rows = torch.tensor(logit_rows, dtype=torch.int64)
            masks = masks[: len(mask_rows)] if in_order else masks[mask_rows]
        ops.apply_token_bitmask(logits, rows, masks)
        return read_later

    def _staging(self) -> MaskStaging:
        if self._mask_staging is None:
            self._mask_staging = MaskStaging(self.config.scheduler.max_num_seqs, self.device)
        return self._mask_staging

    def _sample(
        self, inputs: StepInputs, logits: torch.Tensor, result: StepResult
    ) -> tuple[list[SampledGroup], dict[str, str]]:
        """Queues the sampling of one token per sampling request (row k of `logits` is
        `inputs.samples[k]`) and the copy of the tokens to the host. If the batch cannot
        be sampled, each request is sampled alone: those that fail alone are returned
        (request id -> why) and get nothing; if all of them fail, the error is the
        step's and is raised."""
        failed: dict[str, str] = {}
        if not len(inputs.samples):
            return [], failed
        if self.processors:  # they read the output ids: bring them up to date first
            self._apply_results_before(result)
        states = [inputs.states[i] for i in inputs.samples]
        rows = inputs.rows[inputs.samples]
        try:
            rows_dev = self.buffers.sample_rows.device[: len(rows)]
            groups = [self._sample_rows(states, rows, rows_dev, logits)]
        except Exception as batch_error:
            groups = []
            for k, state in enumerate(states):
                one = rows[k : k + 1]
                try:
                    one_dev = torch.from_numpy(one).to(self.device)
                    groups.append(
                        self._sample_rows([state], one, one_dev, logits[k : k + 1].clone())
                    )
                except Exception as e:  # noqa: BLE001 (tried alone: this request's fault)
                    failed[state.req_id] = f"sampling failed: {type(e).__name__}: {e}"
            if not groups:
                raise batch_error
            logger.warning("requests failed in sampling, the rest of the batch went on: %s", failed)
        for g in groups:
            self.input_batch.mark_pending(g.rows)
        return groups, failed

    def _sample_rows(
        self,
        states: list[CachedRequestState],
        rows: np.ndarray,
        rows_dev: torch.Tensor,
        logits: torch.Tensor,
    ) -> SampledGroup:
        """Queues the sampling of one token for each of `states` (persistent rows `rows`,
        row i of `logits`), with logprobs if any wants them, and their copies to the host."""
        md = self.sampling.metadata(states, rows, rows_dev, self.input_batch.num_pending[rows])
        if self.processors:
            md.rows = rows.tolist()
        result = self.sampler(logits, md)
        self.sampling.record_sampled(rows, rows_dev, result.token_ids)
        self.last_sampled.index_copy_(0, rows_dev, result.token_ids)
        top = None
        if result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.ranks is not None
            ids, lps, ranks = result.logprob_token_ids, result.logprobs, result.ranks
            top = (_to_host(ids), _to_host(lps), _to_host(ranks))
        return SampledGroup(states, rows, _to_host(result.token_ids), top)

    def _prompt_logprobs(
        self, hidden: torch.Tensor | None, prompt_rows: list[PromptLogprobRows]
    ) -> dict[str, PendingLogprobs]:
        """Per request, the logprob and rank of each next prompt token, with the top-n
        (logits in chunks of PROMPT_LOGPROB_CHUNK rows), queued to the host: read once
        the step's event has passed (`PendingLogprobs.read`), no sync here."""
        out: dict[str, PendingLogprobs] = {}
        if not prompt_rows:
            return out
        assert hidden is not None  # (steps with prompt logprobs run eager)
        model = self._loaded_model()
        for p in prompt_rows:
            parts = []
            all_rows, all_targets = (numpy_to_device(a, self.device) for a in (p.rows, p.targets))
            for a in range(0, len(p.rows), PROMPT_LOGPROB_CHUNK):
                rows = all_rows[a : a + PROMPT_LOGPROB_CHUNK]
                targets = all_targets[a : a + PROMPT_LOGPROB_CHUNK]
                logits = model.compute_logits(hidden.index_select(0, rows)).float()
                parts.append(gather_logprobs(logits.log_softmax(-1), targets, p.num_logprobs))
            ids, lps, ranks = (torch.cat(t) for t in zip(*parts))
            out[p.req_id] = PendingLogprobs(_to_host(ids), _to_host(lps), _to_host(ranks))
        return out


@dataclass
class PendingLogprobs:
    """A request's prompt logprobs on their way to the host (`_to_host`)."""

    ids: torch.Tensor  # [positions, 1 + n] int64
    logprobs: torch.Tensor  # [positions, 1 + n] float32
    ranks: torch.Tensor  # [positions] int64

    def read(self) -> TokenLogprobs:
        """Once the copies have run (the step's event)."""
        return TokenLogprobs(self.ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Queues a copy of a device tensor into pinned host memory (valid once the step's
    event has completed); a CPU tensor is returned as it is."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


@dataclass
class SampledGroup:
    """Requests sampled together, and their results on their way to the host."""

    states: list[CachedRequestState]
    rows: np.ndarray
    tokens: torch.Tensor  # [n] int64, host
    top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # ids, logprobs, ranks


class StepResult:
    """A launched step. `result()` waits for its tokens (and the steps launched before
    it), applies them to the persistent batch once, and returns the step's output."""

    def __init__(
        self,
        runner: ModelRunner,
        groups: list[SampledGroup],
        failed: dict[str, str],
        prompt_logprobs: dict[str, PendingLogprobs],
        done: torch.cuda.Event | None,
    ) -> None:
        self._runner = runner
        self._groups = groups
        self._done = done
        self._output: ModelRunnerOutput | None = None
        self._failed, self._prompt_logprobs = failed, prompt_logprobs
        # Set while the step's sampling waits for its grammar bitmask: queues it.
        self.finish: Callable[[], None] | None = None

    def finish_launch(self) -> None:
        """Queues the sampling of a step launched with `grammar_bitmask_later`, once the
        scheduler has filled its bitmask; nothing for any other step."""
        if self.finish is not None:
            self.finish()

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._runner.apply_results_through(self)
        assert self._output is not None
        return self._output

    def apply(self) -> None:
        if self._output is not None:
            return
        self.finish_launch()  # (a step is always sampled before its results are read)
        if self._done is not None:
            self._done.synchronize()
        batch = self._runner.input_batch
        requests = batch.requests
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        # Everything is read to the host first (prompt logprobs may take milliseconds):
        # an interrupt meanwhile leaves the batch as it was, and the step in flight.
        prompt_logprobs = {rid: p.read() for rid, p in self._prompt_logprobs.items()}
        takes = []
        for g in self._groups:
            tokens = g.tokens.tolist()
            states = g.states
            ids = [s.req_id for s in states]
            sampled.update(zip(ids, [[t] for t in tokens]))
            if g.top is not None:  # (the sampler computes them when any row wants them)
                top_ids, lps, ranks = (t.tolist() for t in g.top)
                for k, state in enumerate(states):
                    want = state.sampling_params.logprobs
                    if want is not None:
                        logprobs[state.req_id] = TokenLogprobs(
                            [top_ids[k][: 1 + want]], [lps[k][: 1 + want]], [ranks[k]]
                        )
            live = [requests.get(rid) is s for rid, s in zip(ids, states)]
            if all(live):
                takes.append((states, g.rows, tokens))
            elif any(live):  # (some were dropped meanwhile: their rows are not theirs now)
                keep = np.flatnonzero(live)
                takes.append(([states[k] for k in keep], g.rows[keep], [tokens[k] for k in keep]))
        output = ModelRunnerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed=self._failed,
        )
        for take in takes:
            batch.take_sampled_tokens(*take)
        self._output = output
        self._groups = []
