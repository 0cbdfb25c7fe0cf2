"""The sharded layers and the group API at TP = 2 (then PP = 2) on gloo over loopback.

Two processes run every check of `tp_worker.CHECKS` in one start (a process and its
torch import cost seconds on a small CI machine); each check is reported here as a
test of its own. A rank that dies ends the run at once, a run that stalls is killed
at a deadline: a failure, never a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.tp_worker import CHECK_NAMES

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
DEADLINE_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankRun:
    results: list[dict[str, str | None]]  # per rank: check -> None or its error
    failure: str | None  # why the run ended early, with the ranks' output


def run_ranks(out_dir: Path) -> RankRun:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    init_method = f"tcp://127.0.0.1:{free_port()}"
    logs = [out_dir / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    for r in range(WORLD):
        with open(logs[r], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.distributed.tp_worker"]
                    + [str(r), str(WORLD), init_method, str(out_dir)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    failure = None
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            codes = [p.poll() for p in procs]
            if any(code not in (None, 0) for code in codes):
                time.sleep(0.5)  # the peer of a failed rank usually fails at once too
                failure = f"a rank failed: exit codes {[p.poll() for p in procs]}"
                break
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                failure = f"the ranks did not finish within {DEADLINE_S} s"
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # a rank left waiting for a dead peer
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    if failure is not None:
        output = "\n".join(f"--- rank {r}:\n{logs[r].read_text()[-4000:]}" for r in range(WORLD))
        failure = f"{failure}\n{output}"
    results = []
    for r in range(WORLD):
        path = out_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return RankRun(results, failure)


@pytest.fixture(scope="module")
def rank_run(tmp_path_factory) -> RankRun:
    return run_ranks(tmp_path_factory.mktemp("tp2"))


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_at_tp2(rank_run, name):
    errors = [f"rank {r}:\n{res[name]}" for r, res in enumerate(rank_run.results) if res.get(name)]
    assert not errors, "\n".join(errors)
    missed = [r for r, res in enumerate(rank_run.results) if name not in res]
    if missed:
        stops = [next((n for n, e in res.items() if e), None) for res in rank_run.results]
        where = ", ".join(f"rank {r} at {n}" for r, n in enumerate(stops) if n)
        pytest.fail(
            f"not reached: the run stopped ({where or 'before any check failed'}); "
            f"{rank_run.failure}",
            pytrace=False,
        )
