"""Shared helpers for model tests: batched greedy decoding and the tie rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.model.paged_decoder import PagedDecoder

TIE_TOLERANCE = 1e-3


def greedy_batch(
    decoder: PagedDecoder, prompts: list[list[int]], max_tokens: int, chunk_size: int | None = None
) -> list[list[int]]:
    """Greedy continuations with all sequences in one batch per step.

    With `chunk_size`, prompts are prefilled in chunks while other sequences already
    decode, so steps mix prefill chunks and decodes.
    """
    sids = [decoder.add_sequence() for _ in prompts]
    fed = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    try:
        while any(len(o) < max_tokens for o in outs):
            chunks = {}
            for i, sid in enumerate(sids):
                if fed[i] < len(prompts[i]):
                    end = len(prompts[i]) if chunk_size is None else fed[i] + chunk_size
                    chunks[sid] = prompts[i][fed[i] : end]
                elif len(outs[i]) < max_tokens:
                    chunks[sid] = [outs[i][-1]]
            logits = decoder.step(chunks)
            for i, sid in enumerate(sids):
                if sid not in chunks:
                    continue
                if fed[i] < len(prompts[i]):
                    fed[i] += len(chunks[sid])
                    if fed[i] < len(prompts[i]):
                        continue
                if len(outs[i]) < max_tokens:
                    outs[i].append(int(logits[sid][-1].argmax()))
    finally:
        for sid in sids:
            decoder.free(sid)
    return outs


@dataclass
class GreedyComparison:
    equal: bool
    divergence: int | None  # first index that differs
    gap: float | None  # reference's top-2 logit gap there

    @property
    def acceptable(self) -> bool:
        return self.equal or (self.gap is not None and self.gap < TIE_TOLERANCE)


def compare_greedy(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> GreedyComparison:
    """DESIGN.md's tie rule: a divergence counts only where the reference's two best
    logits are within 1e-3; everything before it must match.

    ref_logits: [len(ref), vocab] the reference's logits for each generated token.
    """
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            top2 = ref_logits[i].float().topk(2).values
            return GreedyComparison(False, i, float(top2[0] - top2[1]))
    if len(ours) != len(ref):
        return GreedyComparison(False, n, None)
    return GreedyComparison(True, None, None)


def assert_greedy_parity(
    ref, prompts: list[list[int]], ours: list[list[int]], label: str = ""
) -> None:
    """Our continuations against `generate(do_sample=False)` under the tie rule.

    `ref` is a transformers model, or an `HFGreedyCache` of one.

    Divergences at near-ties are reported (printed); more than two fail the test, as
    that many true ties in a handful of prompts would point at a numerical problem.
    """
    ties = []
    if isinstance(ref, HFGreedyCache):
        for n in {len(got) for got in ours}:
            ref.prefetch([p for p, got in zip(prompts, ours, strict=True) if len(got) == n], n)
    for prompt, got in zip(prompts, ours, strict=True):
        if hasattr(ref, "generate"):
            want, want_logits = hf_greedy(ref, prompt, len(got))
        else:
            want, want_logits = ref(prompt, len(got))
        cmp = compare_greedy(got, want, want_logits)
        assert cmp.acceptable, (
            f"{label} prompt of {len(prompt)} tokens diverged at {cmp.divergence}, top-2 gap {cmp.gap}"
        )
        if not cmp.equal:
            ties.append((len(prompt), cmp.divergence, cmp.gap))
    if ties:
        print(f"{label} divergences at near-ties (prompt length, index, gap): {ties}")
    assert len(ties) <= 2, f"{label} too many tie divergences: {ties}"


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate with EOS disabled: tokens and their logits."""
    return hf_greedy_batch(model, [prompt], max_tokens)[0]


def hf_greedy_batch(
    model, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy generate (EOS disabled) for several prompts in one
    left-padded call: tokens and logits per prompt (2x faster on the CPU than a call per
    prompt; tokens equal, logits within ~1e-4 of those calls)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    # None counts as "unset" in generate(), which then falls back to the model's own
    # generation config: EOS is switched off there, for the duration of the call.
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
    finally:
        model.generation_config.eos_token_id = saved
    logits = torch.stack(out.logits, dim=1).float().cpu()
    return [(out.sequences[i, width:].tolist(), logits[i]) for i in range(len(prompts))]


class HFGreedyCache:
    """transformers' greedy continuations (EOS off) per (prompt, max_tokens), each
    computed once; `prefetch` computes the missing ones of a list in one batch."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache: dict[tuple[tuple[int, ...], int], tuple[list[int], torch.Tensor]] = {}

    def prefetch(self, prompts: list[list[int]], max_tokens: int) -> None:
        missing = list(
            dict.fromkeys(tuple(p) for p in prompts if (tuple(p), max_tokens) not in self.cache)
        )
        if missing:
            answers = hf_greedy_batch(self.model, [list(p) for p in missing], max_tokens)
            self.cache.update({(p, max_tokens): a for p, a in zip(missing, answers, strict=True)})

    def __call__(self, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
        self.prefetch([prompt], max_tokens)
        return self.cache[(tuple(prompt), max_tokens)]


def use_backend(model, backend) -> None:
    for layer in model.model.layers:
        layer.self_attn.backend = backend


def run_steps_with_backend(
    model, backend, prompts: list[list[int]], decode_steps: int
) -> torch.Tensor:
    """Prefill in uneven chunks (a mixed step: one sequence's whole one-token prompt with
    the others' longer chunks), then decodes of random tokens; every step's logits,
    stacked. For comparing attention backends on the same weights."""
    use_backend(model, backend)
    dec = PagedDecoder(model, backend, num_blocks=512)
    sids = [dec.add_sequence() for _ in prompts]
    outs = []
    cut = [len(p) // 3 for p in prompts]
    first = dec.step({s: p[:c] for s, p, c in zip(sids, prompts, cut) if c}, all_logits=True)
    rest = dec.step({s: p[c:] for s, p, c in zip(sids, prompts, cut)}, all_logits=True)
    outs += [first[s] for s in sids if s in first] + [rest[s] for s in sids]
    gen = torch.Generator().manual_seed(1)
    high = max(max(p) for p in prompts) + 1  # decode tokens from the prompts' range
    for _ in range(decode_steps):
        toks = torch.randint(0, high, (len(sids),), generator=gen).tolist()
        step = dec.step({s: [t] for s, t in zip(sids, toks)})
        outs += [step[s].reshape(1, -1) for s in sids]
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs]).float()
