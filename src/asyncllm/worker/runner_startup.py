"""The model runner's start-up work, run by the worker: the memory profile (a step at
the largest shapes, for the caller to read the peak of, and the decode graphs' memory,
measured on throwaway graphs), the CUDA-graph capture, and the attention backend's
warm-up. Every batch run here is inert: nothing is written to the KV cache (every slot
is -1)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncllm.distributed.parallel_state import get_tp_group
from asyncllm.model.attention.backend import AttentionWarmUp
from asyncllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from asyncllm.worker.cuda_graph import DecodeGraphs, GraphKey
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.step_sampler import PROMPT_LOGPROB_CHUNK


class RunnerStartup:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # What each throwaway graph of `profile_decode_graph` took (for the warning
        # when the real graphs take more than estimated)
        self.probe_bytes_by_key: dict[GraphKey, int] = {}

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Runs a step at the largest shapes, so the caller can read the peak memory:
        the forward of `max_num_batched_tokens` tokens (sequences of at most
        `max_model_len`), sampling `max_num_seqs` rows with every transform on, and one
        prompt-logprob chunk. The KV cache is one scratch block per layer, never written
        (every slot is -1); the penalty state and the graphs' logits buffer are
        allocated here for good, so they count as used before the KV cache is sized."""
        r = self.runner
        sched = r.config.scheduler
        T = sched.max_num_batched_tokens
        lens = [min(r.max_model_len, T - i) for i in range(0, T, r.max_model_len)]
        lens = lens[: sched.max_num_seqs]
        T = sum(lens)
        S = len(lens)
        buf = r.buffers
        qsl = buf.query_start_loc.np
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1 : S + 1])
        buf.seq_lens.np[:S] = lens
        buf.block_table.np[:, :S] = 0
        buf.input_ids.np[:T] = 0
        buf.positions.np[:T] = np.concatenate([np.arange(n) for n in lens])
        buf.slot_mapping.np[:, :T] = -1
        buf.copy_to_device(S)
        scratch = r.kv_cache_tensors(1)
        model = r.loaded_model()
        hidden = r.forward(T, S, scratch, inert=True)
        if hidden is None:  # a pipeline stage before the last: it samples nothing
            return
        B = min(sched.max_num_seqs, T)
        logits = model.compute_logits(hidden[:B]).float()
        r.sampling.allocate_penalty_state()
        Sampler()(logits, self._worst_case_metadata(B))  # (user processors: not profiled)
        del logits
        chunk = hidden[: min(PROMPT_LOGPROB_CHUNK, T)]
        lp = model.compute_logits(chunk).float().log_softmax(-1)
        gather_logprobs(lp, torch.zeros(len(chunk), dtype=torch.int64, device=r.device), 20)
        del lp, hidden
        self._profile_micro_batches(T, scratch)
        del scratch
        if r.capture_sizes and r.device.type == "cuda" and r.graph_logits is None:
            verify, q = r.verify_graphs
            rows = max(r.capture_sizes[-1], verify[-1] * q if verify else 0)
            shape = (rows, r.vocab_size)
            r.graph_logits = torch.empty(shape, dtype=torch.float32, device=r.device)

    def _profile_micro_batches(self, T: int, scratch: list[torch.Tensor]) -> None:
        """With micro-batches on, the same T tokens as that many requests split into
        parts, each part's forward on its own stream (whose allocations do not reuse
        the others'): their peak counts too."""
        r = self.runner
        parts = r.ubatches.parts if r.ubatches is not None else 0
        if parts < 2 or T < parts or r.max_model_len * parts < T:
            return
        lens = [T // parts + (i < T % parts) for i in range(parts)]
        buf = r.buffers
        buf.query_start_loc.np[0] = 0
        np.cumsum(lens, out=buf.query_start_loc.np[1 : parts + 1])
        buf.seq_lens.np[:parts] = lens
        buf.block_table.np[:, :parts] = 0
        buf.positions.np[:T] = np.concatenate([np.arange(n) for n in lens])
        buf.slot_mapping.np[:, :T] = -1
        buf.copy_to_device(parts)
        r.forward(T, parts, scratch, inert=True, split=True)

    def _worst_case_metadata(self, B: int) -> SamplingMetadata:
        dev, V = self.runner.device, self.runner.vocab_size
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
            max_num_logprobs=self.runner.config.max_logprobs,
        )

    def _graph_forward(self, kv_caches: list[torch.Tensor]) -> Any:
        """A graph's body: the model over the inert batch of its key, then the logits of
        every row (a verification graph's through the logit rows) into the shared
        output buffer."""
        r = self.runner
        model, out, rows = r.loaded_model(), r.graph_logits, r.buffers.logit_rows.device
        assert out is not None

        def forward(key: GraphKey, metadata: list[Any]) -> None:
            size, q = key
            T = size * q
            hidden = r.forward(T, size, kv_caches, inert=True, attn_metadata=metadata)
            assert hidden is not None  # (no graphs under pipeline parallelism)
            if q > 1:
                hidden = hidden.index_select(0, rows[:T])
            out[:T].copy_(model.compute_logits(hidden))

        return forward

    @torch.inference_mode()
    def profile_decode_graph(self) -> int:
        """The device memory the CUDA graphs will take, measured before the KV cache
        exists: throwaway graphs of the largest and the smallest decode size (and the
        largest verification size) over a one-block cache, captured into one pool as
        the real ones are. The estimate is what they took (the largest's holds the
        pool's intermediates, which smaller graphs reuse) plus the smallest one's
        (mostly an executable's own: its kernel parameters grow with the graph's nodes,
        hundreds per layer in a mixture-of-experts model) for every other graph."""
        r = self.runner
        sizes, (verify, q) = r.capture_sizes, r.verify_graphs
        if not sizes or r.device.type != "cuda":
            return 0
        if r.graph_logits is None:
            raise RuntimeError("profile_run() allocates the graphs' logits: run it first")
        probe = DecodeGraphs(sorted({sizes[0], sizes[-1]}), verify[-1:], q)
        probe.capture(self._inert_graph_batch, self._graph_forward(r.kv_cache_tensors(1)))
        self.probe_bytes_by_key = dict(probe.bytes_by_key)
        smallest = max(probe.bytes_by_key[(sizes[0], 1)], 0)
        others = len(sizes) + len(verify) - len(probe.keys)
        estimate = sum(max(b, 0) for b in probe.bytes_by_key.values()) + smallest * others
        del probe
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return estimate

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> DecodeGraphs | None:
        """Captures the decode (and verification) graphs, after the KV cache exists: they
        bake in its addresses. Nothing is written to the cache, and no random stream is
        used."""
        r = self.runner
        if not r.capture_sizes or r.device.type != "cuda":
            return None
        if r.graph_logits is None:
            raise RuntimeError("profile_run() allocates the graphs' logits: run it first")
        r.graphs = DecodeGraphs(r.capture_sizes, *r.verify_graphs)
        r.graphs.capture(self._inert_graph_batch, self._graph_forward(r.kv_caches))
        return r.graphs

    # -- the attention backend's warm-up ----------------------------------------------

    @torch.inference_mode()
    def warm_up_attention(self) -> int:
        """The attention backend's warm-up (the Triton backend's: one inert mixed batch
        per launch config a step mixing decodes with a prefill chunk can meet, short
        chunks and long, so its kernels compile at start-up, not in the first such step);
        returns the number of batches run."""
        return self.runner.backend.warm_up(self.warm_up_context())

    def warm_up_context(self) -> AttentionWarmUp:
        """The model's attention shape, and a way to run inert mixed batches."""
        r = self.runner
        spec = r.loaded_model().kv_cache_spec()
        hf = r.config.model.hf_config
        # This rank's query heads over its KV heads (KV heads replicate past their count)
        group = hf.num_attention_heads // get_tp_group().world_size // spec.num_kv_heads
        sched = r.config.scheduler
        return AttentionWarmUp(
            device=r.device,
            dtype=r.dtype,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            group=group,
            max_mixed_seqs=min(sched.max_num_seqs, sched.max_num_batched_tokens - 1),
            max_batched_tokens=sched.max_num_batched_tokens,
            run_mixed_batch=self.run_inert_mixed_batch,
        )

    @torch.inference_mode()
    def run_inert_mixed_batch(self, num_seqs: int, chunk: int = 2) -> None:
        """One eager forward of `num_seqs - 1` one-token decodes and a prefill chunk of
        `chunk` tokens that writes nothing to the KV cache (every slot is -1)."""
        r = self.runner
        lens = np.ones(num_seqs, dtype=np.int64)
        lens[-1] = chunk
        T = self._inert_batch(lens)
        r.forward(T, num_seqs, r.kv_caches, inert=True)

    def _inert_graph_batch(self, key: GraphKey) -> list[Any]:
        """A graph's batch of `size` sequences of `q` tokens (a decode graph's: one) that
        writes nothing, and its attention metadata."""
        size, q = key
        if q > 1:  # (copied with the batch: every row's logits)
            self.runner.buffers.logit_rows.np[: size * q] = np.arange(size * q)
        T = self._inert_batch(np.full(size, q, dtype=np.int64))
        return self.runner.attention_metadata(T, size, for_cuda_graph=True)

    def _inert_batch(self, lens: np.ndarray) -> int:
        """Sequences of `lens` tokens (no context) in the step buffers that write nothing
        to the KV cache (every slot -1); returns the token count."""
        buf, S = self.runner.buffers, len(lens)
        T = int(lens.sum())
        buf.query_start_loc.np[0] = 0
        np.cumsum(lens, out=buf.query_start_loc.np[1 : S + 1])
        buf.seq_lens.np[:S] = lens
        buf.block_table.np[:, :S] = 0
        buf.input_ids.np[:T] = 0
        buf.positions.np[:T] = 0
        buf.slot_mapping.np[:, :T] = -1
        buf.copy_to_device(S)
        return T
