"""CUDA graphs on real weights (SmolLM2 from the embedded GGUF): greedy outputs equal
transformers' with graphs on, and graphs on equal graphs off, in float32 under DESIGN.md's
tie rule and in bfloat16 under the relative-norm and top-5 rules, over batches that cross
capture sizes and steps that mix prefills with decodes."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.conftest import LONG_TEXT
from tests.model.helpers import assert_greedy_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package"),
]

ENGINE = dict(
    device="cuda",
    max_model_len=1024,
    gpu_memory_utilization=0.2,  # four engines live at once (two per module fixture)
    multiprocess=False,
    max_num_seqs=128,
    # Small enough that the 100-request batch mixes prefill chunks with decodes.
    max_num_batched_tokens=512,
)
BATCHES = (1, 3, 9, 17, 100)
RECORD_LOGITS = "tests.engine.processors:RecordLogits"


def _runner(llm: LLM):
    return llm.engine.client.core.executor.worker.runner


@pytest.fixture(scope="module")
def prompts32(smollm_prompts16, smollm_tokenizer) -> list[list[int]]:
    long_ids = smollm_tokenizer(LONG_TEXT * 4).input_ids
    more = [long_ids[7 * i : 7 * i + 20 + 13 * i] for i in range(16)]
    return list(smollm_prompts16) + more


def _token_prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 200, (n,), generator=gen).tolist()
    return [torch.randint(0, 49152, (k,), generator=gen).tolist() for k in lens]


def _generate(llm: LLM, prompts, max_tokens: int, logprobs: int | None = None):
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def fp32_engines():
    graphs = LLM(dtype="float32", **ENGINE)
    eager = LLM(dtype="float32", enforce_eager=True, **ENGINE)
    yield graphs, eager
    graphs.shutdown()
    eager.shutdown()


def test_greedy_with_graphs_equals_transformers(fp32_engines, prompts32, hf_cuda):
    graphs, _ = fp32_engines
    runner = _runner(graphs)
    assert runner.graphs is not None and runner.graphs.sizes[0] == 1
    before = runner.graphs.replays
    outs = _generate(graphs, prompts32, 32)
    assert runner.graphs.replays - before >= 20  # the decode steps replayed graphs
    assert_greedy_parity(
        hf_cuda, prompts32, [list(o.token_ids) for o in outs], "graphs vs transformers"
    )
    stats = graphs.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.fixture(scope="module")
def hf_cuda():
    """transformers' SmolLM2 on the GPU, float32 (IEEE dots, as ours)."""
    from transformers import AutoModelForCausalLM

    from asyncllm.model.source import embedded_gguf_path

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.cuda().eval()


def _tie_gap(logprobs: dict) -> float:
    """The gap between the two best logprobs at a position (= the logit gap)."""
    best = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else math.inf


@pytest.mark.parametrize("n", BATCHES)
def test_graphs_on_equal_graphs_off_float32(fp32_engines, n):
    graphs, eager = fp32_engines
    prompts = _token_prompts(n, seed=n)
    want = _generate(eager, prompts, 24, logprobs=2)
    got = _generate(graphs, prompts, 24)
    ties = 0
    for w, g in zip(want, got, strict=True):
        if list(g.token_ids) != list(w.token_ids):
            i = next(k for k, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
            gap = _tie_gap(w.logprobs[i])
            assert gap < 1e-3, f"batch {n}: diverged at {i} with a top-2 gap of {gap}"
            ties += 1
    assert ties <= max(2, n // 20), ties


# The rule for 16-bit outputs, ||a - b|| / ||b|| <= 2e-2 on the logits, holds where both
# engines compute from the same state: the prefill's logits and the first decode step's
# (the prompt's KV entries are the same on both sides). From then on each engine decodes
# from its own KV cache and bf16 rounding compounds: on SmolLM2, transformers' own bf16
# logits differ from its float32 ones by up to 0.07 (relative norm) within 12 tokens, and
# one bf16 engine run at batch 9 and at batch 1 by up to 0.08 (docs/benchmarks.md). Later
# positions are held to DRIFT_TOL, which still catches a graph that reads a stale or
# foreign row (those differ by ~1), and to the top-5 rule.
SAME_STATE_TOL = 2e-2
DRIFT_TOL = 0.1


def compare_bf16_logits(graphs: LLM, eager: LLM, batches=BATCHES, max_tokens: int = 16) -> int:
    """bf16: at every position up to a request's first divergence the two engines' logits
    agree to SAME_STATE_TOL (positions 0 and 1) or DRIFT_TOL (later), and where the
    tokens differ each side's token is in the other's top 5. Both engines record their
    logits (`RecordLogits`). Returns the number of positions compared."""
    seen, worst = 0, [0.0, 0.0]
    for n in batches:
        rec_g, rec_e = _runner(graphs).processors[0], _runner(eager).processors[0]
        prompts = _token_prompts(n, seed=100 + n)
        want = _generate(eager, prompts, max_tokens)
        got = _generate(graphs, prompts, max_tokens)
        for p, w, g in zip(prompts, want, got, strict=True):
            for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
                x, y = rec_g.logits[(tuple(p), i)], rec_e.logits[(tuple(p), i)]
                rel = ((x - y).norm() / y.norm()).item()
                same_state = i <= 1
                worst[not same_state] = max(worst[not same_state], rel)
                assert rel <= (SAME_STATE_TOL if same_state else DRIFT_TOL), (n, i, rel)
                seen += 1
                if a != b:
                    assert a in y.topk(5).indices and b in x.topk(5).indices, (n, i, a, b)
                    break
        rec_g.logits.clear()
        rec_e.logits.clear()
    print(
        f"bf16 graphs against eager, worst relative norm: same state {worst[0]:.4f}, later {worst[1]:.4f}"
    )
    return seen


def test_graphs_on_equal_graphs_off_bfloat16():
    kw = dict(ENGINE, dtype="bfloat16", logits_processors=[RECORD_LOGITS])
    graphs = LLM(**kw)
    eager = LLM(enforce_eager=True, **kw)
    try:
        assert _runner(graphs).graphs is not None and _runner(eager).graphs is None
        assert compare_bf16_logits(graphs, eager) >= sum(BATCHES)
    finally:
        graphs.shutdown()
        eager.shutdown()


def test_enforce_eager_captures_nothing(fp32_engines):
    _, eager = fp32_engines
    runner = _runner(eager)
    assert runner.graphs is None and runner.capture_sizes == []
