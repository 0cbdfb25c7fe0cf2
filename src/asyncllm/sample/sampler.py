"""Token selection for a batch of requests, on the device, without per-request syncs.

Order (vLLM's): raw logprobs (if asked) from the model's logits; then logit bias,
min_tokens (EOS and stop tokens masked, unless nothing else is left: a grammar at its
end), the user processors that can change the argmax, repetition / presence / frequency
penalties; then greedy argmax, or temperature, min-p, the argmax-invariant user
processors, top-k, top-p and a draw (greedy-only batches never call the invariant ones).
Random draws use the exponential-race trick (argmax of p / E with E ~ Exp(1)), taken in
log space, argmax(logits / T - log E), so no softmax is computed; one row of noise per
request: seeded requests draw theirs from their own generator, so their tokens do not
depend on what else is in the batch. With `ASYNCLLM_FLASHINFER_SAMPLING=1`, on CUDA with
FlashInfer installed, a step with top-k or top-p draws its unseeded rows with
FlashInfer's sorting-free kernel instead. A step with no greedy row computes no argmax of
the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncllm.envs import flashinfer_sampling_enabled
from asyncllm.sample import ops
from asyncllm.sample.logits_processor import DraftPrefixes, LogitsProcessor, apply_processor


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float (greedy rows: 1.0); None if all_greedy
    is_greedy: torch.Tensor | None  # [B] bool; None if all_greedy
    all_greedy: bool
    any_greedy: bool = True  # False: no row is greedy (no argmax of the raw logits)
    top_k: torch.Tensor | None = None  # [B] long, 0 = off
    top_p: torch.Tensor | None = None  # [B] float
    min_p: torch.Tensor | None = None  # [B] float
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch index -> gen
    repetition_penalty: torch.Tensor | None = None  # [B]
    seen_mask: torch.Tensor | None = None  # [B, V] prompt or output token seen
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [B, V]
    logit_bias: torch.Tensor | None = None  # [B, V] additive
    blocked_tokens: list[tuple[int, list[int]]] = field(default_factory=list)  # (index, ids)
    max_num_logprobs: int | None = None
    rows: list[int] = field(default_factory=list)  # persistent-batch rows, for processors
    # Rows at draft positions, for processors (`logits_processor.apply_processor`)
    draft_prefixes: DraftPrefixes | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + n]: sampled, then top-n
    logprobs: torch.Tensor | None = None  # [B, 1 + n]
    ranks: torch.Tensor | None = None  # [B]


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: int):
    """Column 0: the chosen token's logprob; then the n best; and the chosen one's rank."""
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1))
    ranks = (logprobs >= chosen_lp).sum(-1)  # (ties count against it, as in vLLM)
    if n > 0:
        top_lp, top_ids = logprobs.topk(n, dim=-1)
        ids = torch.cat([chosen.unsqueeze(-1), top_ids], -1)
        lps = torch.cat([chosen_lp, top_lp], -1)
    else:
        ids, lps = chosen.unsqueeze(-1), chosen_lp
    return ids, lps, ranks


class Sampler:
    def __init__(self, processors: list[LogitsProcessor] | None = None) -> None:
        processors = processors or []
        self.argmax_changing = [p for p in processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in processors if p.is_argmax_invariant()]
        self._flashinfer: bool | None = None  # (decided at the first top-k / top-p draw)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        num_logprobs = md.max_num_logprobs
        raw_logprobs = logits.log_softmax(-1) if num_logprobs is not None else None
        logits = self.apply_penalties_and_processors(logits, md)
        if md.all_greedy:
            tokens = logits.argmax(-1)
        else:
            drawn = self.sample_random(logits, md)
            if md.any_greedy:
                assert md.is_greedy is not None, "a step with greedy rows needs is_greedy"
                tokens = torch.where(md.is_greedy, logits.argmax(-1), drawn)
            else:
                tokens = drawn
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None and num_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.ranks = gather_logprobs(
                raw_logprobs, tokens, num_logprobs
            )
        return out

    def apply_penalties_and_processors(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> torch.Tensor:
        if md.logit_bias is not None:
            logits = logits + md.logit_bias
        elif md.blocked_tokens or self.argmax_changing:
            logits = logits.clone()  # (changed in place below: the caller's stay as they are)
        for i, ids in md.blocked_tokens:
            ops.block_tokens_(logits[i], ids)
        for proc in self.argmax_changing:
            logits = apply_processor(proc, logits, md.rows, md.draft_prefixes)
        if md.repetition_penalty is not None:
            assert md.seen_mask is not None, "a repetition penalty needs seen_mask"
            logits = ops.apply_repetition_penalty(logits, md.seen_mask, md.repetition_penalty)
        if md.output_counts is not None:
            assert md.presence_penalty is not None and md.frequency_penalty is not None, (
                "output_counts come with presence_penalty and frequency_penalty"
            )
            logits = ops.apply_presence_frequency(
                logits, md.output_counts, md.presence_penalty, md.frequency_penalty
            )
        return logits

    def sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        assert md.temperature is not None, "random sampling needs temperatures"
        logits = logits / md.temperature.unsqueeze(-1)
        if md.min_p is not None:
            logits = ops.apply_min_p(logits, md.min_p)
        for proc in self.argmax_invariant:
            logits = apply_processor(proc, logits, md.rows, md.draft_prefixes)
        if (md.top_k is not None or md.top_p is not None) and self.use_flashinfer(logits):
            return self.sample_top_k_top_p_flashinfer(logits, md)
        return self.sample_top_k_top_p_torch(logits, md)

    def use_flashinfer(self, logits: torch.Tensor) -> bool:
        if self._flashinfer is None:
            self._flashinfer = flashinfer_sampling_enabled()
        return self._flashinfer and logits.device.type == "cuda"

    def sample_top_k_top_p_flashinfer(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> torch.Tensor:
        """FlashInfer's top-k-then-top-p draw (rejection sampling over the probabilities,
        no sort). It draws every row from one random stream, so rows seeded with their
        own generator are drawn again on the torch path (their tokens must not depend on
        the batch)."""
        from flashinfer.sampling import top_k_top_p_sampling_from_logits

        vocab = logits.shape[-1]
        top_k = (
            md.top_k if md.top_k is not None else torch.zeros_like(logits[:, 0], dtype=torch.long)
        )
        top_k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).to(torch.int32)
        top_p = md.top_p if md.top_p is not None else torch.ones_like(logits[:, 0])
        drawn = top_k_top_p_sampling_from_logits(logits, top_k, top_p.float()).long()
        if md.generators:
            seeded = torch.tensor(sorted(md.generators), device=logits.device)
            sub = SamplingMetadata(
                temperature=None, is_greedy=None, all_greedy=False,
                top_k=md.top_k.index_select(0, seeded) if md.top_k is not None else None,
                top_p=md.top_p.index_select(0, seeded) if md.top_p is not None else None,
                generators={j: md.generators[i] for j, i in enumerate(sorted(md.generators))},
            )  # fmt: skip
            again = self.sample_top_k_top_p_torch(logits.index_select(0, seeded), sub)
            drawn.index_copy_(0, seeded, again)
        return drawn

    def sample_top_k_top_p_torch(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.top_k is not None:
            logits = ops.apply_top_k(logits, md.top_k)
        if md.top_p is not None:
            logits = ops.apply_top_p(logits, md.top_p)
        noise = torch.empty_like(logits).exponential_()
        for i, gen in md.generators.items():
            noise[i].exponential_(generator=gen)
        # argmax(softmax(l) / E) = argmax(l - log E): the softmax's normalizer is per row.
        return logits.sub_(noise.log_()).argmax(-1)
