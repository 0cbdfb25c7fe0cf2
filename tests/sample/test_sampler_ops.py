"""Each logit transform equals transformers' own logits processor, or the direct formula."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from asyncllm.sample import ops
from asyncllm.sample.logits_processor import LogitsProcessor
from asyncllm.sample.sampler import Sampler, SamplingMetadata

V = 300


def _logits(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    finite = torch.isfinite(b)
    assert torch.allclose(a[finite], b[finite], atol=1e-6)


@pytest.mark.parametrize("k", [1, 5, 50, V])
def test_top_k_equals_transformers(k):
    x = _logits(k)
    _same(ops.apply_top_k(x, torch.full((4,), k)), TopKLogitsWarper(k)(None, x.clone()))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_equals_transformers(p):
    x = _logits(int(p * 100))
    _same(ops.apply_top_p(x, torch.full((4,), p)), TopPLogitsWarper(p)(None, x.clone()))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_equals_transformers(min_p):
    x = _logits(7)
    _same(ops.apply_min_p(x, torch.full((4,), min_p)), MinPLogitsWarper(min_p)(None, x.clone()))


def test_temperature_equals_transformers():
    x = _logits(3)
    md = SamplingMetadata(
        temperature=torch.full((4,), 0.7),
        is_greedy=torch.zeros(4, dtype=torch.bool),
        all_greedy=False,
    )
    _same(x / md.temperature.unsqueeze(-1), TemperatureLogitsWarper(0.7)(None, x.clone()))


@pytest.mark.parametrize("penalty", [0.8, 1.3])
def test_repetition_penalty_equals_transformers(penalty):
    x = _logits(11)
    ids = torch.randint(0, V, (4, 20), generator=torch.Generator().manual_seed(1))
    seen = ops.bincount_rows(ids.tolist(), V, torch.device("cpu")) > 0
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone())
    _same(ops.apply_repetition_penalty(x, seen, torch.full((4,), penalty)), want)


def test_per_row_parameters_are_independent():
    x = _logits(5)
    k = torch.tensor([0, 1, 7, 0])
    got = ops.apply_top_k(x, k)
    assert torch.equal(got[0], x[0]) and torch.equal(got[3], x[3])
    assert torch.isfinite(got[1]).sum() == 1 and torch.isfinite(got[2]).sum() == 7


def test_presence_frequency_and_logit_bias_follow_the_formula():
    x = _logits(9, rows=2)
    outputs = [[3, 3, 3, 7], [5]]
    counts = ops.bincount_rows(outputs, V, torch.device("cpu"))
    got = ops.apply_presence_frequency(
        x, counts, torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.0])
    )
    want = x.clone()
    want[0, 3] -= 0.25 * 3 + 0.5
    want[0, 7] -= 0.25 * 1 + 0.5
    want[1, 5] -= -1.0
    assert torch.allclose(got, want)

    bias = torch.zeros(2, V)
    bias[0, 10], bias[1, 20] = 5.0, -100.0
    md = SamplingMetadata(
        temperature=torch.ones(2),
        is_greedy=torch.ones(2, dtype=torch.bool),
        all_greedy=True,
        logit_bias=bias,
    )
    assert torch.allclose(Sampler().apply_penalties_and_processors(x.clone(), md), x + bias)


def test_blocked_tokens_can_never_be_chosen():
    x = torch.zeros(2, V)
    x[:, 42] = 100.0
    md = SamplingMetadata(
        temperature=torch.ones(2),
        is_greedy=torch.ones(2, dtype=torch.bool),
        all_greedy=True,
        blocked_tokens=[(0, [42])],
    )
    tokens = Sampler()(x, md).token_ids
    assert tokens[0] != 42 and tokens[1] == 42


def test_seeded_draws_follow_the_generator_only():
    x = _logits(2, rows=3)

    def draw(order):
        rows = x[order]
        gens = {}
        for i, r in enumerate(order):
            if r == 1:
                gens[i] = torch.Generator().manual_seed(1234)
        md = SamplingMetadata(
            temperature=torch.ones(3),
            is_greedy=torch.zeros(3, dtype=torch.bool),
            all_greedy=False,
            generators=gens,
        )
        return Sampler()(rows, md).token_ids[order.index(1)].item()

    assert len({draw([0, 1, 2]), draw([2, 0, 1]), draw([1, 2, 0])}) == 1


def test_random_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    x = probs.log().expand(4000, 3).contiguous()
    md = SamplingMetadata(
        temperature=torch.ones(4000),
        is_greedy=torch.zeros(4000, dtype=torch.bool),
        all_greedy=False,
    )
    torch.manual_seed(0)
    freq = torch.bincount(Sampler()(x, md).token_ids, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_logprobs_are_raw_and_rank_the_chosen_token():
    x = _logits(4, rows=2)
    md = SamplingMetadata(
        temperature=torch.ones(2),
        is_greedy=torch.ones(2, dtype=torch.bool),
        all_greedy=True,
        max_num_logprobs=3,
        logit_bias=torch.zeros(2, V).index_fill_(1, torch.tensor([0]), 50.0),
    )
    out = Sampler()(x, md)
    raw = x.log_softmax(-1)
    assert out.token_ids.tolist() == [0, 0]  # the bias chose token 0...
    assert torch.allclose(out.logprobs[:, 0], raw[:, 0])  # ...but logprobs are before the bias
    assert torch.equal(out.ranks, (raw > raw[:, :1]).sum(-1) + 1)
    assert torch.allclose(out.logprobs[:, 1:], raw.topk(3).values)


def test_the_log_space_draw_is_the_exponential_race():
    """argmax(logits / T - log E) picks what argmax(softmax(logits / T) / E) picks with
    the same noise E; greedy rows of a mixed step take the argmax, and a step without
    greedy rows (any_greedy False) draws every row."""
    torch.manual_seed(0)
    B, V = 64, 1000
    logits = torch.randn(B, V) * 3
    temperature = torch.rand(B) + 0.3
    is_greedy = torch.arange(B) % 4 == 0
    state = torch.get_rng_state()
    mixed = SamplingMetadata(temperature=temperature, is_greedy=is_greedy, all_greedy=False)
    tokens = Sampler()(logits.clone(), mixed).token_ids
    torch.set_rng_state(state)
    noise = torch.empty_like(logits).exponential_()
    race = (logits / temperature[:, None]).softmax(-1).div(noise).argmax(-1)
    assert torch.equal(tokens, torch.where(is_greedy, logits.argmax(-1), race))
    assert (race[is_greedy] != logits.argmax(-1)[is_greedy]).any()  # the rows differ
    torch.set_rng_state(state)
    none_greedy = SamplingMetadata(
        temperature=temperature,
        is_greedy=torch.zeros(B, dtype=torch.bool),
        all_greedy=False,
        any_greedy=False,
    )
    assert torch.equal(Sampler()(logits.clone(), none_greedy).token_ids, race)


def test_min_tokens_blocks_the_end_unless_nothing_else_is_left():
    from asyncllm.sample.ops import block_tokens_

    inf = float("inf")
    logits = torch.tensor(
        [
            [0.5, 2.0, -1.0, 3.0],  # (other tokens allowed: the end tokens 1 and 3 go)
            [-inf, 2.0, -inf, 3.0],  # (a grammar at its end: only 1 and 3 allowed)
            [-inf, -inf, -inf, -inf],  # (nothing at all: stays so)
        ]
    )
    want = logits.clone()
    want[0, [1, 3]] = -inf
    for i in range(3):
        block_tokens_(logits[i], [1, 3])
    assert torch.equal(logits, want)


def test_a_sampled_token_tied_with_others_ranks_after_them_as_in_vllm():
    from asyncllm.sample.sampler import gather_logprobs

    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.5]]), -1)
    _, _, ranks = gather_logprobs(logprobs, torch.tensor([2]), 0)
    assert ranks.tolist() == [2]  # (tied with token 1: both count)
    _, _, ranks = gather_logprobs(logprobs, torch.tensor([0]), 0)
    assert ranks.tolist() == [3]


class _Seen(LogitsProcessor):
    """Keeps a copy of the logits it is given; changes nothing."""

    def __init__(self, invariant: bool) -> None:
        super().__init__(V, torch.device("cpu"))
        self.invariant = invariant
        self.seen: list[torch.Tensor] = []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self.seen.append(logits.clone())
        return logits


def test_user_processors_run_where_vllm_runs_them():
    """Argmax-changing processors: after logit bias, before the repetition penalty;
    argmax-invariant ones: after temperature and min-p, and only with a random row."""
    x = _logits(7, rows=2)
    changing, invariant = _Seen(False), _Seen(True)
    bias = torch.zeros(2, V)
    bias[:, 3] = 4.0
    temperature, min_p = torch.tensor([0.5, 2.0]), torch.tensor([0.1, 0.0])
    md = SamplingMetadata(
        temperature=temperature,
        is_greedy=torch.tensor([False, True]),
        all_greedy=False,
        min_p=min_p,
        repetition_penalty=torch.tensor([1.3, 1.3]),
        seen_mask=torch.ones(2, V, dtype=torch.bool),
        logit_bias=bias,
        rows=[0, 1],
    )
    Sampler([invariant, changing])(x.clone(), md)
    assert len(changing.seen) == 1 and torch.allclose(changing.seen[0], x + bias)
    penalized = ops.apply_repetition_penalty(x + bias, md.seen_mask, md.repetition_penalty)
    want = ops.apply_min_p(penalized / temperature.unsqueeze(-1), min_p)
    assert len(invariant.seen) == 1
    _same(invariant.seen[0], want)

    greedy = SamplingMetadata(temperature=None, is_greedy=None, all_greedy=True, rows=[0, 1])
    Sampler([invariant, changing])(x.clone(), greedy)
    assert len(changing.seen) == 2 and len(invariant.seen) == 1
