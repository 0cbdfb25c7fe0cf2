"""The prompt-lookup proposer against a plain reference: the longest recurring suffix
(between min and max tokens), its latest earlier occurrence, the tokens after it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncllm.core.ngram_proposer import NgramProposer, propose_ngram


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    n = len(tokens)
    for size in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - size :]
        for start in range(n - size - 1, -1, -1):  # (latest first; not the suffix itself)
            if tokens[start : start + size] == suffix:
                end = start + size
                return tokens[end : min(end + k, n)]
    return []


def test_the_longest_match_wins_then_the_latest() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0 (followed by 9, 5); [2, 3] also at 5 (followed by 8)
    assert propose_ngram(np.array(tokens), 1, 3, 2) == [9, 5]
    # at most 2 tokens long: [2, 3] at 5 is the latest
    assert propose_ngram(np.array(tokens), 1, 2, 3) == [8, 7, 1]
    # at least 4 tokens: nothing
    assert propose_ngram(np.array(tokens), 4, 5, 3) == []


def test_no_recurrence_and_short_contexts_give_nothing() -> None:
    assert propose_ngram(np.array([1, 2, 3, 4]), 1, 3, 3) == []
    assert propose_ngram(np.array([7]), 1, 3, 3) == []
    assert propose_ngram(np.array([7, 7]), 1, 3, 3) == [7]  # (drafts stop at the end)


@pytest.mark.parametrize("seed", range(40))
def test_equals_the_reference_on_random_contexts(seed: int) -> None:
    r = random.Random(seed)
    vocab = r.choice([2, 3, 5, 20])
    tokens = [r.randrange(vocab) for _ in range(r.randint(1, 120))]
    lo = r.randint(1, 3)
    hi = r.randint(lo, 6)
    k = r.randint(1, 6)
    assert propose_ngram(np.array(tokens), lo, hi, k) == reference(tokens, lo, hi, k)


def test_a_requests_buffer_grows_with_its_tokens_and_is_forgotten() -> None:
    p = NgramProposer(2, 4, 3)
    tokens = [5, 6, 7, 8, 5, 6]
    assert p.propose("a", tokens) == [7, 8, 5]
    tokens += [7] + list(range(100, 200))  # (past the buffer's first size)
    tokens += [5, 6]
    assert p.propose("a", tokens) == reference(tokens, 2, 4, 3) == [7, 100, 101]
    assert p.propose("a", tokens, max_drafts=1) == [7]
    p.forget("a")
    assert p.propose("a", [1, 2, 1, 2]) == [1, 2]  # (a new request with the id)


def test_bad_lookup_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 1)
