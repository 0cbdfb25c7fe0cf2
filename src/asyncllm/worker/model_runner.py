"""Runs one scheduled step, in the order `_launch` reads: update the persistent batch
(`_update_states`), fill the step buffers with numpy (`_prepare_inputs`), run the model
(`_run_model`: a CUDA-graph replay for decode steps that fit a captured size, eager
otherwise), mask and sample (`_finish_launch`), and hand back a `StepResult`.

Logits are computed for each request's last scheduled token when that token ends
what is known of the request (a finished prefill or a decode), and, in chunks of
`PROMPT_LOGPROB_CHUNK` rows, for every prompt position of requests that asked for
prompt logprobs (`step_sampler.py`).

Per step nothing allocates a tensor from a Python list: inputs go through the
preallocated `StepBuffers`, sampling parameters and penalty state live per row on the
device (`SamplingState`), and the sampled ids come back in one device-to-host copy.

Async scheduling: `execute_model_async` queues the step and returns a `StepResult`
(`step_result.py`) before its tokens are known; the next step may be launched before
`result()` is called. The sampled ids also stay on the device, by persistent row
(`last_sampled`), and a decode whose input token is still being sampled by the step in
flight gets it there by a device-side scatter (`InputBatch.num_pending` counts such
tokens). User logits processors read the requests' output ids, so a step with
processors applies the results in flight before sampling (after its forward is queued).

A bad value in one request never fails the step: each new request is checked (and its
per-request state built) on its own, and one that cannot be taken is dropped from the
batch and reported in `ModelRunnerOutput.failed`; if sampling still fails, each
request is retried alone, and only those that fail alone are reported. An error no
request can be blamed for propagates (the engine dies).

Start-up work (memory profile, graph capture, the attention backend's warm-up) is in
`runner_startup.py`; structured outputs (bitmasks, a device step's handshake) in
`grammar_rows.py`. The attention backend comes from the registry
(`model/attention/registry.py`): nothing here depends on which one it is.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
from typing import Any

import numpy as np
import torch

from asyncllm.config import EngineConfig
from asyncllm.distributed.parallel_state import get_pp_group
from asyncllm.model.attention.backend import CommonAttentionMetadata
from asyncllm.model.attention.registry import (
    AttentionCGSupport,
    AttentionNeeds,
    choose_attention_backend,
)
from asyncllm.model.interface import CausalLM
from asyncllm.model.kv_groups import engine_kv_cache_layout
from asyncllm.model.loader import load_model
from asyncllm.model.pipeline import HIDDEN_STATES, IntermediateTensors
from asyncllm.request_checks import check_params_for_model, check_prompt_token_ids
from asyncllm.sample.logits_processor import LogitsProcessor, load_logits_processor_class
from asyncllm.step_io import (
    GrammarSync,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncllm.worker.cuda_graph import DecodeGraphs
from asyncllm.worker.grammar_rows import GrammarRows
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.sampling_state import SamplingState
from asyncllm.worker.step_buffers import StepBuffers, padded_size
from asyncllm.worker.step_inputs import StepInputs, gather_step_inputs
from asyncllm.worker.step_result import SampledGroup, StepResult, StepsInFlight
from asyncllm.worker.step_sampler import PromptLogprobRows, StepSampler, prompt_logprob_rows
from asyncllm.worker.ubatch import MicroBatches, parts_independent

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.dtype = mc.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = mc.max_model_len
        needs = AttentionNeeds.of_model(mc.hf_config, self.device, self.dtype, self.block_size)
        self.attention, self.backend = choose_attention_backend(config.attention_backend, needs)
        sched = config.scheduler
        max_blocks = -(-self.max_model_len // self.block_size)
        self.kv_layout = engine_kv_cache_layout(config)
        groups = len(self.kv_layout.groups)
        self.input_batch = InputBatch(sched.max_num_seqs, self.max_model_len, max_blocks, groups)
        self.vocab_size = int(mc.hf_config.vocab_size)
        # This rank's pipeline stage: a stage before the last hands its hidden states to
        # the next and samples nothing; one after the first takes the previous one's.
        self.pp = get_pp_group()
        self.first_stage, self.last_stage = self.pp.is_first_rank, self.pp.is_last_rank
        # Decode batches up to the largest captured size are padded to a captured size
        # (and replayed as a graph on CUDA once captured).
        self.capture_sizes = self._capture_sizes()
        # Steps verifying drafts, up to the speculation limit, padded likewise where the
        # backend runs query lengths above 1 inside a graph: (sizes, tokens per request).
        self.verify_graphs = self._verify_graph_sizes()
        self.buffers = StepBuffers(
            max(sched.max_num_batched_tokens, self.capture_sizes[-1] if self.capture_sizes else 0),
            sched.max_num_seqs,
            max_blocks,
            self.device,
            groups,
            # (a request verifying drafts samples each of its positions)
            sched.max_num_seqs + sched.max_num_batched_tokens if sched.speculative else None,
        )
        self.sampling = SamplingState(sched.max_num_seqs, self.vocab_size, self.device)
        self.processors: list[LogitsProcessor] = [
            load_logits_processor_class(path)(self.vocab_size, self.device)
            for path in config.logits_processors
        ]
        self.model: CausalLM | None = None  # set by load_model, dropped at shutdown
        self.kv_caches: list[torch.Tensor] = []  # per layer of this stage (shared: kv_groups)
        self._layer_groups: list[int] | None = None  # (see layer_groups)
        self.graphs: DecodeGraphs | None = None
        self.graph_logits: torch.Tensor | None = None  # [largest size, vocab] float32
        # Each persistent row's last sampled token, on the device (async scheduling); the
        # row past the last holds -1 (a device step's token for a request not held).
        self.last_sampled = torch.zeros(
            sched.max_num_seqs + 1, dtype=torch.int64, device=self.device
        )
        self.last_sampled[-1] = -1
        self.in_flight = StepsInFlight()  # launched, results not applied
        self.step_sampler = StepSampler(
            self.input_batch,
            self.sampling,
            self.processors,
            self.buffers,
            self.last_sampled,
            self.device,
        )
        # Micro-batches of eager steps (EngineArgs.ubatch; None: off)
        if config.ubatch != "off" and not self.backend.streams_safe:
            raise ValueError(
                f"ubatch={config.ubatch!r} needs an attention backend whose step can run on "
                f"several CUDA streams at once; {self.attention.name} plans each step into "
                "one shared wrapper and workspace (use ubatch='off', or attention_backend='triton')"
            )
        self.ubatches = (
            MicroBatches(
                config.ubatch,
                str((getattr(mc.hf_config, "architectures", None) or [""])[0]),
                int(mc.hf_config.hidden_size),
                self.device,
            )
            if config.ubatch != "off"
            else None
        )
        self.num_split_steps = 0  # steps run in micro-batches
        self.grammar = GrammarRows(
            self.input_batch, self.buffers, self.last_sampled, sched.max_num_seqs, self.device
        )

    def _capture_sizes(self) -> list[int]:
        """The configured decode graph sizes, unless the attention backend cannot run a
        one-token decode batch inside a CUDA graph (then every step runs eager)."""
        sizes = sorted(self.config.cudagraph_capture_sizes)
        if sizes and self.pp.world_size > 1:
            logger.info("no CUDA graphs at pipeline_parallel_size > 1 (yet): every step runs eager")
            return []
        if sizes and self.attention.cudagraph_support == AttentionCGSupport.NEVER:
            logger.info(
                "attention backend %s runs no CUDA graphs: every step runs eager",
                self.attention.name,
            )
            return []
        return sizes

    def _verify_graph_sizes(self) -> tuple[list[int], int]:
        """The captured sizes that verification steps (1 + k tokens per request) are
        padded to: those up to the largest batch that drafts (fewer requests than
        `disable_by_batch_size`) whose tokens fit a step; none without speculation, or
        where the attention backend cannot run such a batch inside a CUDA graph."""
        sched = self.config.scheduler
        spec, sizes = sched.speculative, self.capture_sizes
        if spec is None or not sizes:
            return [], 1
        if self.attention.cudagraph_support.value < AttentionCGSupport.UNIFORM_BATCH.value:
            logger.info(
                "attention backend %s runs no multi-token queries inside CUDA graphs: "
                "steps verifying drafts run eager",
                self.attention.name,
            )
            return [], 1
        q = 1 + spec.num_speculative_tokens
        most = min(spec.disable_by_batch_size - 1, sched.max_num_seqs)
        if most < 1:  # (no request ever drafts)
            return [], 1
        top = padded_size(most, sizes) or sizes[-1]
        return [s for s in sizes if s <= top and s * q <= sched.max_num_batched_tokens], q

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.backend)

    def loaded_model(self) -> CausalLM:
        if self.model is None:
            raise RuntimeError("the model is not loaded: call load_model() first")
        return self.model

    @property
    def layer_groups(self) -> list[int]:
        """The KV cache group of each layer of this stage (`model/kv_groups.py`)."""
        if self._layer_groups is None:
            layers = self.loaded_model().kv_cache_spec().layers
            self._layer_groups = [self.kv_layout.tensor_of(i)[0] for i in layers]
        return self._layer_groups

    def _tensor_indices(self) -> list[int]:
        """The KV tensor of each layer of this stage (`model/kv_groups.py`)."""
        layout = self.kv_layout
        return [layout.tensor_of(i)[1] for i in self.loaded_model().kv_cache_spec().layers]

    def kv_cache_block_bytes(self) -> int:
        """Bytes of one block id over this stage's KV tensors."""
        spec = self.loaded_model().kv_cache_spec()
        per_layer = spec.block_bytes(self.block_size, self.dtype) // spec.num_layers
        return per_layer * len(set(self._tensor_indices()))

    def kv_cache_tensors(self, num_blocks: int) -> list[torch.Tensor]:
        """The KV cache of each layer of this stage, in the attention backend's layout:
        the layers of different KV cache groups at one index share a tensor."""
        spec = self.loaded_model().kv_cache_spec()
        shape = self.backend.kv_cache_shape(
            num_blocks, self.block_size, spec.num_kv_heads, spec.head_size
        )
        indices = self._tensor_indices()
        tensors = {j: self._zeros(shape) for j in sorted(set(indices))}
        return [tensors[j] for j in indices]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed KV cache tensor. On the CPU, an anonymous mapping: the OS hands out
        zeroed pages when they are first touched, so the part of the cache no request
        reaches costs neither the time to clear it nor memory."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * self.dtype.itemsize
        memory = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # (fewer faults and TLB misses, as torch's own)
            memory.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(memory, dtype=self.dtype).view(shape)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.kv_cache_tensors(num_blocks)

    # -- the step ------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step and returns its results."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepResult:
        """Queues the step on the device; its `result()` waits for the tokens."""
        if self.in_flight:
            self.in_flight.last().finish_launch()  # (its logits must be sampled first)
        result = self._launch(so)
        self.in_flight.append(result)
        return result

    def _launch(self, so: SchedulerOutput) -> StepResult:
        """Queues the step: update the persistent batch, prepare the inputs, run the
        model, then sample (at once, or once the grammar bitmask is filled, for a step
        launched with `grammar_bitmask_later`); hands back the result to come."""
        failed = self._update_states(so)
        scheduled = self._scheduled(so, failed)
        if not self.last_stage:
            return self._launch_stage(scheduled, failed)
        sync = self.grammar.sync(so)
        result = StepResult(self.in_flight, self.input_batch, failed)
        if not scheduled:
            if sync is not None:
                self.grammar.handshake_alone(sync)
            return result
        inputs = self._prepare_inputs(scheduled, sync, so.scheduled_spec_decode_tokens)
        # Picked before sampling appends tokens: whether a request still owes prompt
        # logprobs depends on the tokens it had when the step began.
        prompt_rows = prompt_logprob_rows(inputs, self.input_batch)
        hidden, logits = self._run_model(inputs, prompt_rows)
        finish = functools.partial(
            self._finish_launch, so, result, inputs, prompt_rows, hidden, logits, sync
        )
        if so.grammar_bitmask_later:
            result.finish = finish  # (the forward is queued; `finish_launch` samples)
        else:
            finish()
        return result

    def _launch_stage(self, scheduled: dict[str, int], failed: dict[str, str]) -> StepResult:
        """A pipeline stage before the last: runs its layers and sends its hidden states
        to the next stage; its result samples nothing."""
        result = StepResult(self.in_flight, self.input_batch, failed)
        if scheduled:
            inputs = self._prepare_inputs(scheduled)
            self.forward(inputs.num_tokens, len(inputs.states), self.kv_caches)
            self.input_batch.num_computed_tokens[inputs.rows] = inputs.seq_lens
        result.sampled([], {}, {}, None)
        return result

    def _scheduled(self, so: SchedulerOutput, failed: dict[str, str]) -> dict[str, int]:
        """The step's requests the runner holds (request id -> tokens, in batch order)."""
        batch = self.input_batch
        scheduled = so.num_scheduled_tokens
        if failed or not all(rid in batch.requests for rid in scheduled):
            # (requests the runner could not take, now or in an earlier step: the
            # scheduler ends them; its own dict stays as it was)
            scheduled = {rid: n for rid, n in scheduled.items() if rid in batch.requests}
        return scheduled

    @torch.inference_mode()
    def _finish_launch(
        self,
        so: SchedulerOutput,
        result: StepResult,
        inputs: StepInputs,
        prompt_rows: list[PromptLogprobRows],
        hidden: torch.Tensor | None,
        logits: torch.Tensor,
        sync: GrammarSync | None = None,
    ) -> None:
        """Queues the rest of a launched step: the grammar masks, the sampling, prompt
        logprobs and the copies to the host."""
        result.finish = None
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        # (queued before the masking: nothing in them waits for the host)
        prompt_logprobs = self.step_sampler.prompt_logprobs(
            self.loaded_model(), hidden, prompt_rows
        )
        graphed = self._logits_graphed(logits, inputs)
        self.grammar.mask_logits(so, sync, inputs, logits, graphed, done)
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
        result.sampled(groups, sample_failed, prompt_logprobs, done)

    def _logits_graphed(self, logits: torch.Tensor, inputs: StepInputs) -> bool:
        """Whether `logits` are a decode graph's output (an address that stays, one row
        per request; a verification graph's have more rows than the step has masks)."""
        return (
            inputs.graph_query_len == 1
            and self.graph_logits is not None
            and logits.data_ptr() == self.graph_logits.data_ptr()
        )

    def _sample(
        self, inputs: StepInputs, logits: torch.Tensor, result: StepResult
    ) -> tuple[list[SampledGroup], dict[str, str]]:
        """Queues the sampling (`StepSampler.sample`); the results of the steps launched
        before this one are applied first where logits processors read them."""
        return self.step_sampler.sample(inputs, logits, lambda: self.in_flight.apply_before(result))

    # -- the persistent batch --------------------------------------------------------------

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
        # (a stage that samples holds its requests' tokens: the last one)
        tokens = cached.new_token_ids if not self.last_stage else []
        for i, (rid, blocks, num_computed) in enumerate(
            zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
        ):
            state = requests.get(rid)
            if state is None:
                continue  # the runner could not take it in an earlier step
            if blocks:
                batch.append_blocks(state.row, blocks)
            if tokens:
                batch.write_tokens(state, num_computed, tokens[i])
            rows.append(state.row)
            computed.append(num_computed)
        if rows:
            batch.num_computed_tokens[rows] = computed
        return failed

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
        hold, more logprobs than the vocabulary): the core's admission check passed it,
        but a request changed since must fail alone. The same checks (request_checks)."""
        vocab = self.vocab_size
        tokens = new.prompt_token_ids + new.output_token_ids
        check_prompt_token_ids(tokens, vocab, max_model_len=len(tokens))
        check_params_for_model(new.sampling_params, vocab, max_logprobs=vocab)
        if not 0 <= new.num_computed_tokens <= len(tokens):
            raise ValueError(f"num_computed_tokens {new.num_computed_tokens} is out of range")

    # -- inputs and the forward ------------------------------------------------------------

    def _prepare_inputs(
        self,
        scheduled: dict[str, int],
        sync: GrammarSync | None = None,
        drafts: dict[str, list[int]] | None = None,
    ) -> StepInputs:
        """Fills the step buffers (`scheduled`: request id -> tokens, in batch order;
        `drafts`: the draft tokens requests verify),
        pads a decode step to its captured size, and queues the copies to the device;
        for a device step (`sync`), then the tokens ahead to the grammar process (the
        last ones sampled for its requests); last, the device-side scatter of the input
        tokens the step in flight is still sampling."""
        buf = self.buffers
        buf.wait_until_writable()
        inputs = gather_step_inputs(
            self.input_batch,
            buf,
            scheduled,
            self.block_size,
            self.capture_sizes,
            drafts,
            self.verify_graphs,
        )
        if sync is not None:
            self.grammar.write_rows(sync)
        T, S, size = inputs.num_tokens, len(inputs.states), inputs.graph_size
        if size is not None:
            padded = size * inputs.graph_query_len
            buf.pad(T, S, padded, size)
            if inputs.graph_query_len > 1:  # (the graph computes logits of every row)
                buf.logit_rows.np[inputs.num_logit_rows : padded] = 0
            buf.copy_to_device(size)
        else:
            buf.copy_to_device(S)
        buf.step_queued()
        if sync is not None:
            self.grammar.give_tokens_ahead(sync)
        if inputs.num_pending:
            k = inputs.num_pending
            sampled = self.last_sampled.index_select(0, buf.pending_rows.device[:k])
            buf.input_ids.device.index_copy_(0, buf.pending_at.device[:k], sampled)
        return inputs

    def attention_metadata(
        self,
        T: int,
        S: int,
        for_cuda_graph: bool = False,
        seqs: tuple[int, int] | None = None,
    ) -> list[Any]:
        """The backend's attention metadata of each layer of this stage (one per KV
        cache group, shared by its layers) over the first T tokens and S sequences of
        the step buffers (already on the device); `for_cuda_graph`: a decode graph's
        batch (captured or about to be replayed); `seqs`: only the sequences
        [first, end) and their tokens (a micro-batch)."""
        buf = self.buffers
        a, b = seqs or (0, S)
        t0 = int(buf.query_start_loc.np[a])
        t1 = int(buf.query_start_loc.np[b]) if seqs else T
        qsl = buf.query_start_loc.np[a : b + 1]
        qsl_device = buf.query_start_loc.device[a : b + 1]
        if t0:  # (a micro-batch after the first: its offsets from its own first token)
            qsl, qsl_device = qsl - t0, qsl_device - t0
        seq_lens = buf.seq_lens.np[a:b]
        per_group = {}
        layer_groups = self.layer_groups
        for g in sorted(set(layer_groups)):
            common = CommonAttentionMetadata(
                query_start_loc=qsl_device,
                seq_lens=buf.seq_lens.device[a:b],
                block_table=buf.block_table.device[g, a:b],
                slot_mapping=buf.slot_mapping.device[g, t0:t1],
                query_start_loc_cpu=qsl,
                seq_lens_cpu=seq_lens,
                num_actual_tokens=int(qsl[-1]),
                max_query_len=int(np.diff(qsl).max()) if b > a else 0,
                max_seq_len=int(seq_lens.max()) if b > a else 0,
                block_table_cpu=buf.block_table.np[g, a:b],
                kv_group=g,
                for_cuda_graph=for_cuda_graph,
            )
            per_group[g] = self.backend.build_metadata(common, self.block_size)
        return [per_group[g] for g in layer_groups]

    def forward(
        self,
        T: int,
        S: int,
        kv_caches: list[torch.Tensor],
        inert: bool = False,
        attn_metadata: list[Any] | None = None,
        split: bool = False,
    ) -> torch.Tensor | None:
        """The model over the first T tokens and S sequences of the step buffers: its
        hidden states on the last pipeline stage, None on the others, which send theirs
        to the next stage (a stage after the first receives the previous one's first).
        An `inert` batch (start-up: profiling, capture, warm-up) passes nothing between
        stages: a stage after the first runs on uninitialised inputs of the same shape.
        `attn_metadata`: built beforehand (a graph capture builds it outside the graph);
        by default built here. `split`: in micro-batches where `ubatch` says (a step of
        one stage, not a decode graph's batch)."""
        model = self.loaded_model()
        parts = self._micro_batches(T, S) if split else None
        if parts is not None:
            assert self.ubatches is not None
            self.num_split_steps += 1
            return self.ubatches.run(parts, lambda a, b: self._forward_part(a, b, kv_caches))
        received: IntermediateTensors | None = None
        if not self.first_stage:
            if inert:
                received = model.make_empty_intermediate_tensors(T, self.dtype, self.device)
            else:
                received = self.pp.recv_tensor_dict()
                got = received[HIDDEN_STATES].shape[0]
                if got != T:
                    raise RuntimeError(
                        f"pipeline stage {self.pp.rank_in_group} received {got} tokens' "
                        f"hidden states for a step of {T}: the stages' batches differ"
                    )
        out = model(
            self.buffers.input_ids.device[:T],
            self.buffers.positions.device[:T],
            kv_caches,
            attn_metadata if attn_metadata is not None else self.attention_metadata(T, S),
            received,
        )
        if self.last_stage:
            assert isinstance(out, torch.Tensor)
            return out
        assert isinstance(out, dict)
        if not inert:
            self.pp.send_tensor_dict(out)
        return None

    def _micro_batches(self, T: int, S: int) -> list[tuple[int, int]] | None:
        """The step's micro-batches (runs of whole requests), or None to run it whole."""
        if self.ubatches is None or not (self.first_stage and self.last_stage):
            return None
        buf = self.buffers
        qsl = buf.query_start_loc.np[: S + 1]
        parts = self.ubatches.plan(qsl)
        if parts is None or not parts_independent(
            parts,
            qsl,
            buf.seq_lens.np[:S],
            buf.block_table.np[:, :S],
            buf.slot_mapping.np[:, :T],
            self.block_size,
        ):
            return None
        return parts

    def _forward_part(self, a: int, b: int, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The hidden states of the step's sequences [a, b) alone (a micro-batch)."""
        qsl = self.buffers.query_start_loc.np
        t0, t1 = int(qsl[a]), int(qsl[b])
        out = self.loaded_model()(
            self.buffers.input_ids.device[t0:t1],
            self.buffers.positions.device[t0:t1],
            kv_caches,
            self.attention_metadata(t1, b, seqs=(a, b)),
            None,
        )
        assert isinstance(out, torch.Tensor)
        return out

    def _run_model(
        self, inputs: StepInputs, prompt_rows: list[PromptLogprobRows]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden states [T, hidden] or None after a graph replay, float32 logits of
        the sampling requests in batch order); writes the step's K/V into the cache."""
        size, S, q = inputs.graph_size, len(inputs.states), inputs.graph_query_len
        R = inputs.num_logit_rows
        model = self.loaded_model()
        if size is not None and self.graphs is not None and not prompt_rows:
            assert self.graph_logits is not None
            if self.backend.plans_on_host:
                self.attention_metadata(size * q, size, for_cuda_graph=True)
            self.graphs.replay(size, q)
            return None, self.graph_logits[:R]
        # (padded on the CPU too, to test the padding)
        T = size * q if size is not None else inputs.num_tokens
        hidden = self.forward(T, size or S, self.kv_caches, split=size is None)
        assert hidden is not None  # (the last stage's)
        if not R:
            return hidden, hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        if R == T and not inputs.spec:
            last = hidden
        else:
            last = hidden.index_select(0, self.buffers.logit_rows.device[:R])
        return hidden, model.compute_logits(last).float()[:R]
