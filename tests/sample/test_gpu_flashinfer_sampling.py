"""FlashInfer's top-k / top-p draw (on CUDA where it is installed) keeps the torch path's
distribution: a chi-square test of many draws from fixed logits against the
probabilities the torch path's filters leave; and seeded rows still follow their own
generator whatever else is in the batch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from asyncllm.sample import ops
from asyncllm.sample.sampler import Sampler, SamplingMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
    ),
]


@pytest.fixture(autouse=True)
def _flashinfer_sampling_on(monkeypatch):
    monkeypatch.setenv("ASYNCLLM_FLASHINFER_SAMPLING", "1")


V, N = 200, 100_000
# The chi-square statistic's 99.9th percentile for df degrees of freedom is below
# df + 3.1 * sqrt(2 df) + 10 for the df met here (a fixed-seed run: not flaky).


def _md(rows: int, top_k: int, top_p: float, generators=None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(rows, device="cuda"),
        is_greedy=torch.zeros(rows, dtype=torch.bool, device="cuda"),
        all_greedy=False,
        any_greedy=False,
        top_k=torch.full((rows,), top_k, dtype=torch.long, device="cuda"),
        top_p=torch.full((rows,), top_p, device="cuda"),
        generators=generators or {},
    )


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (0, 0.8), (30, 0.9)])
def test_flashinfer_draws_keep_the_filtered_distribution(top_k, top_p):
    row = torch.randn(V, generator=torch.Generator().manual_seed(7)).cuda() * 2
    sampler = Sampler()
    assert sampler.use_flashinfer(row[None])
    torch.manual_seed(0)
    drawn = sampler(row.expand(N, V).contiguous(), _md(N, top_k, top_p)).token_ids
    filtered = row[None]
    if top_k:
        filtered = ops.apply_top_k(filtered, torch.tensor([top_k], device="cuda"))
    filtered = ops.apply_top_p(filtered, torch.tensor([top_p], device="cuda"))
    probs = filtered.softmax(-1)[0].double()
    counts = torch.bincount(drawn, minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the filtered set was drawn"
    expected = probs[support] * N
    chi2 = (((counts[support] - expected) ** 2) / expected).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < df + 3.1 * (2 * df) ** 0.5 + 10, (chi2, df)


def test_seeded_rows_follow_their_generator_whatever_the_batch():
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(2)).cuda()

    def draw(order: list[int]) -> int:
        gens = {
            i: torch.Generator(device="cuda").manual_seed(1234)
            for i, r in enumerate(order)
            if r == 1
        }
        out = Sampler()(x[order], _md(3, 40, 0.9, gens)).token_ids
        return int(out[order.index(1)])

    assert len({draw([0, 1, 2]), draw([2, 0, 1]), draw([1, 2, 0])}) == 1
