"""What the engine-level distributed tests share: the tiny-engine settings, the prompts,
the tie-rule comparison (DESIGN.md), and a look at the processes an engine started."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from asyncllm import SamplingParams
from asyncllm.executor.multiproc import MultiprocExecutor
from tests.conftest import children
from tests.model.helpers import TIE_TOLERANCE

TINY = dict(
    device="cpu",
    dtype="float32",
    max_model_len=128,
    skip_tokenizer_init=True,
    cpu_threads=1,
)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPT_LENGTHS = [1, 3, 7, 12, 20, 33, 40, 64]


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(n)] for n in PROMPT_LENGTHS]


PROMPTS = make_prompts()


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_equal_under_tie_rule(ref_outs, outs, label: str) -> None:
    """Greedy tokens equal to the reference's, but where they first diverge the
    reference's two best logprobs were within TIE_TOLERANCE (at most two such)."""
    ties = []
    for i, (ref, got) in enumerate(zip(ref_outs, outs, strict=True)):
        want, have = list(ref.outputs[0].token_ids), list(got.outputs[0].token_ids)
        if want == have:
            continue
        assert len(want) == len(have), f"{label} prompt {i}: {len(have)} tokens, not {len(want)}"
        at = next(k for k, (a, b) in enumerate(zip(want, have)) if a != b)
        top = sorted((lp.logprob for lp in ref.outputs[0].logprobs[at].values()), reverse=True)
        gap = top[0] - top[1]
        assert gap < TIE_TOLERANCE, f"{label} prompt {i} diverged at {at}, top-2 gap {gap}"
        ties.append((i, at, gap))
    if ties:
        print(f"{label}: divergences at near-ties (prompt, index, gap): {ties}")
    assert len(ties) <= 2, f"{label}: too many tie divergences: {ties}"


# -- processes -----------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """A live process (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_pids(parent: int) -> list[int]:
    """The worker processes `parent` started, by rank."""
    found = {}
    for pid in children(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"asyncllm.executor.multiproc_worker" in argv:
            found[int(argv[argv.index(b"--rank") + 1])] = pid
    return [found[r] for r in sorted(found)]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("asyncllm_shmq_")}


def check_greedy_with_preemption_and_prefix_hits(
    llm, ref_outs, label: str, exact: bool = False, num_blocks: int = 16
) -> None:
    """PROMPTS greedily on `llm` (a KV cache of `num_blocks` blocks: the eight prompts
    preempt each other) equal `ref_outs` (exactly, or under the tie rule); then the
    longest prompt alone takes its full blocks from the prefix cache, and every block
    comes back."""
    outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    if exact:
        assert token_ids(outs) == token_ids(ref_outs), label
    else:
        assert_equal_under_tie_rule(ref_outs, outs, label)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0, stats
    again = llm.generate(as_inputs(PROMPTS[-1:]), GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens >= 48
    assert token_ids(again) == token_ids(outs[-1:])
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] == num_blocks


def check_seeded_sampling_and_logprobs(ref_llm, llm) -> None:
    """Seeded sampling with logprobs and prompt logprobs on four prompts: `llm` gives
    `ref_llm`'s tokens, and logprobs within 1e-4."""
    params = [
        SamplingParams(
            max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i, logprobs=3, prompt_logprobs=2
        )
        for i in range(4)
    ]
    prompts = as_inputs(PROMPTS[2:6])
    want = ref_llm.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for w, g in zip(want, got, strict=True):
        for wp, gp in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert wp.keys() == gp.keys()
            assert max(abs(wp[t].logprob - gp[t].logprob) for t in wp) < 1e-4
        for wp, gp in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            assert wp.keys() == gp.keys()
            assert max(abs(wp[t].logprob - gp[t].logprob) for t in wp) < 1e-4


class StreamTokens:
    """A stream's tokens as an output the tie-rule check reads."""

    def __init__(self, tokens: list[int]) -> None:
        self.outputs = [type("C", (), {"token_ids": tokens})()]


class StallingExecutor(MultiprocExecutor):
    """The multiprocess executor with worker rank 1 stopped (SIGSTOP) as soon as it is
    started: it never says it is ready."""

    def _launch(self, startups) -> None:
        super()._launch(startups)
        os.kill(self._workers[1].pid, signal.SIGSTOP)
