"""Verification keeps the model's distribution. Each verified position is sampled as
the next output token would be (temperature, top-k/top-p after all processing), a
draft is kept while it equals its position's sample, and the first sample that differs
ends the tokens: so a draft is accepted with the model's probability of it, and a
rejected position yields the model's distribution without the draft. Checked with
chi-square tests over 100k verifications of two drafts (the sampler and
`SampledGroup.accepted`, as the runner uses them), seed fixed."""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.sample.sampler import Sampler, SamplingMetadata
from asyncllm.worker.step_result import SampledGroup

N = 100_000
V = 8
DRAFTS = [2, 5]


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square test's p-value of observed counts against probabilities."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert (expected >= 5).all()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_verification_keeps_the_target_distribution() -> None:
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(99)
    # the model's logits at the three verified positions (after the last token, after
    # draft 0, after draft 1), each a different distribution over 8 tokens
    base = torch.randn(3, V, generator=gen) * 0.5
    base[0, DRAFTS[0]] += 1.0  # (drafts the model often, not always, agrees with)
    base[1, DRAFTS[1]] += 1.0
    temperature = 0.9
    # rows: position 0 of every verification, then position 1, then 2
    logits = torch.cat([base[0].expand(N, V), base[1].expand(N, V), base[2].expand(N, V)])
    md = SamplingMetadata(
        temperature=torch.full((3 * N,), temperature),
        is_greedy=torch.zeros(3 * N, dtype=torch.bool),
        all_greedy=False,
        any_greedy=False,
    )
    tokens = Sampler([])(logits.clone(), md).token_ids
    # the runner's layout: each verification's first row, then its draft rows in order
    first, second, third = tokens[:N], tokens[N : 2 * N], tokens[2 * N :]
    layout = torch.cat([first, torch.stack([second, third], 1).reshape(-1)]).tolist()
    group = SampledGroup(
        states=[None] * N,  # type: ignore[list-item]
        rows=np.arange(N),
        tokens=torch.empty(0),
        top=None,
        spec=[(k, DRAFTS) for k in range(N)],
    )
    new = [t for t, _ in group.accepted(layout).values()]
    probs = torch.softmax(base / temperature, -1).double().numpy()

    # the first new token: the model's distribution at position 0
    firsts = np.bincount([t[0] for t in new], minlength=V)
    assert p_value(firsts, probs[0]) > 1e-3
    # draft 0 kept with the model's probability of it
    kept = np.array([len(t) > 1 for t in new])
    assert abs(kept.mean() - probs[0][DRAFTS[0]]) < 4 * np.sqrt(probs[0][DRAFTS[0]] / N)
    # where draft 0 was rejected: the distribution without it
    rejected = np.bincount([t[0] for t in new if len(t) == 1], minlength=V)
    without = probs[0].copy()
    without[DRAFTS[0]] = 0
    assert rejected[DRAFTS[0]] == 0
    assert p_value(rejected, without / without.sum()) > 1e-3
    # after draft 0 was kept: position 1's distribution, and so on
    seconds = np.bincount([t[1] for t in new if len(t) > 1], minlength=V)
    assert p_value(seconds, probs[1]) > 1e-3
    thirds = np.bincount([t[2] for t in new if len(t) > 2], minlength=V)
    assert p_value(thirds, probs[2]) > 1e-3
    assert max(map(len, new)) == 3  # (both drafts kept, then the bonus token)
