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


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


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
