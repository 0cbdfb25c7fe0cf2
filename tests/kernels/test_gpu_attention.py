"""The paged attention kernel on the GPU: ~50 random bf16 cases against the float32
reference, every output poisoned beforehand, and a captured launch replayed on new
inputs written into the same buffers."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from asyncllm_kernels.paged_attention import paged_attention
from asyncllm_kernels.reference import paged_attention_ref
from tests.kernels.attention_cases import make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _draw(seed: int) -> dict:
    """One case from the space the kernel must cover; sizes bounded so that the float32
    reference fits in memory and time."""
    r = random.Random(seed)
    q_len = r.choice([1, 1, 7, 128, 1000])
    max_batch = {1: 256, 7: 64, 128: 8, 1000: 3}[q_len]
    batch = r.randint(1, max_batch)
    max_ctx = min(32768, 600_000 // batch)
    seqs = []
    for _ in range(batch):
        ql = q_len if q_len == 1 else r.randint(1, q_len)
        seqs.append((ql, ql + r.randint(0, max_ctx)))
    return dict(
        seqs=seqs,
        num_kv_heads=r.choice([1, 2, 4, 8]),
        group=r.choice([1, 2, 3, 4, 8]),
        head_size=r.choice([64, 128, 256]),
        block_size=r.choice([16, 32]),
        window=r.choice([None, None, r.randint(1, 4096)]),
        cap=r.choice([None, None, 30.0]),
    )


@pytest.mark.parametrize("seed", range(50))
def test_random_case_bf16(seed):
    _check_random_case(seed, torch.bfloat16, 1e-2)


@pytest.mark.parametrize("seed", [100, 105, 110, 111, 116, 126])
def test_random_case_float32_ieee(seed):
    """Float32 inputs use IEEE dots: as exact as the reference, up to summation order."""
    _check_random_case(seed, torch.float32, 1e-5)


def _check_random_case(seed: int, dtype: torch.dtype, tol: float) -> None:
    p = _draw(seed)
    case = make_case(
        p["seqs"], p["num_kv_heads"], p["group"], p["head_size"], p["block_size"],
        dtype, "cuda", seed=seed, pad_seqs=seed % 3, pad_tokens=seed % 2,
    )  # fmt: skip
    scale = p["head_size"] ** -0.5
    out = torch.full_like(case.q, float("nan"))
    paged_attention(
        *case.args(), scale=scale, max_query_len=case.max_query_len,
        has_decodes=case.has_decodes, sliding_window=p["window"], soft_cap=p["cap"], out=out,
    )  # fmt: skip
    torch.cuda.synchronize()
    n = case.num_tokens
    assert not out[:n].isnan().any(), "unwritten or NaN outputs"
    want = paged_attention_ref(
        *(t.float() if t.is_floating_point() else t for t in case.args()),
        scale=scale, sliding_window=p["window"], soft_cap=p["cap"],
    )  # fmt: skip
    err = rel_err(out[:n], want[:n])
    assert err <= tol, f"{p['seqs'][:4]}... {p} rel err {err:.2e}"


class _CapturedLaunch:
    """One `paged_attention` launch captured over copies of `first`'s inputs (its block
    table widened to 200 blocks, room for any draw); `replay(new)` writes `new`'s inputs
    into the same buffers, poisons the output, replays and returns it."""

    def __init__(self, first: Any, scale: float, max_query_len: int) -> None:
        bufs = [t.clone() for t in first.args()]
        bt = torch.zeros(bufs[3].shape[0], 200, dtype=torch.int32, device="cuda")
        bt[:, : bufs[3].shape[1]] = bufs[3]
        bufs[3] = bt
        self.bufs, self.out = bufs, torch.empty_like(bufs[0])

        def run():
            paged_attention(*bufs, scale=scale, max_query_len=max_query_len, out=self.out)

        run()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            run()

    def replay(self, new: Any) -> torch.Tensor:
        for buf, t in zip(self.bufs, new.args()):
            if buf.dim() == 2 and buf.dtype == torch.int32:  # block table: keep its width
                buf.zero_()
                buf[:, : t.shape[1]] = t
            else:
                buf.copy_(t)
        self.out.fill_(float("nan"))
        self.graph.replay()
        torch.cuda.synchronize()
        return self.out


@pytest.mark.parametrize("decode", [True, False])
def test_graph_replay_with_new_inputs(decode):
    """Capture once, then write new lengths, tables, queries and caches into the same
    buffers: the replay must compute the new batch (nothing per step was frozen)."""
    q_len = 1 if decode else 9
    shape = dict(num_kv_heads=2, group=4, head_size=128, block_size=16)

    def draw(seed):
        r = random.Random(seed)
        seqs = [(q_len, q_len + r.randint(0, 3000)) for _ in range(6)]
        return make_case(seqs, **shape, dtype=torch.bfloat16, device="cuda", seed=seed,
                         spare_blocks=1200 - sum(-(-n // 16) for _, n in seqs))  # fmt: skip

    launch = _CapturedLaunch(draw(0), 0.088, q_len)
    for seed in (1, 2, 3):
        new = draw(seed)
        out = launch.replay(new)
        want = paged_attention_ref(*new.args(), scale=0.088)
        assert rel_err(out, want) <= 1e-2


def test_graph_of_uniform_chunks_replays_ragged_and_padded_batches():
    """A verification graph's launch: captured over 6 chunks of 5 tokens (decode + 4
    drafts), replayed on batches of fewer sequences (the rest empty) whose chunks have
    1 to 5 tokens (drafts differ per request; the rest of q is padding)."""
    S, Q = 6, 5
    shape = dict(num_kv_heads=2, group=3, head_size=64, block_size=16, dtype=torch.bfloat16,
                 device="cuda")  # fmt: skip

    def case(seqs, seed, n):  # (1200 blocks each: the caches' shape stays)
        spare = 1200 - sum(-(-total // 16) for _, total in seqs)
        T = sum(ql for ql, _ in seqs)
        return make_case(seqs, seed=seed, pad_seqs=S - n, pad_tokens=S * Q - T,
                         spare_blocks=spare, **shape)  # fmt: skip

    launch = _CapturedLaunch(case([(Q, Q + 100 * i) for i in range(S)], 0, S), 0.125, Q)
    for seed in range(1, 7):
        r = random.Random(seed)
        n = r.randint(1, S)
        seqs = [(ql, ql + r.randint(0, 2500)) for ql in (r.randint(1, Q) for _ in range(n))]
        T = sum(ql for ql, _ in seqs)
        new = case(seqs, seed, n)
        out = launch.replay(new)
        want = paged_attention_ref(*new.args(), scale=0.125)
        assert rel_err(out[:T], want[:T]) <= 1e-2, (seed, seqs)
