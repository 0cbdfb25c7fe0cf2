"""Multi-process checks, the pattern of test_tensor_parallel.py in reusable pieces.

A rank script (`python -m MODULE RANK WORLD INIT_METHOD OUT_DIR`) runs a list of named
checks in order with `run_checks`, writing `OUT_DIR/rank{RANK}.json` (check -> None or
its error) after each; the first failure ends the rank. `run_ranks` starts every rank
at once (one start: a process and its torch import cost seconds on a small CI
machine), ends the run as soon as a rank dies and kills a run that stalls past its
deadline; `assert_check_passed` turns one check's results into a test's verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankRun:
    results: list[dict[str, str | None]]  # per rank: check -> None or its error
    failure: str | None  # why the run ended early, with the ranks' output


def run_ranks(module: str, world: int, out_dir: Path, deadline_s: float) -> RankRun:
    """Runs `python -m module RANK WORLD INIT_METHOD OUT_DIR` for every rank (gloo over
    loopback, one thread each) and collects their results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    init_method = f"tcp://127.0.0.1:{free_port()}"
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, str(r), str(world), init_method, str(out_dir)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    failure = None
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            codes = [p.poll() for p in procs]
            if any(code not in (None, 0) for code in codes):
                for p in procs:  # the peer of a failed rank usually fails at once too
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=2.0)
                failure = f"a rank failed: exit codes {[p.poll() for p in procs]}"
                break
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                failure = f"the ranks did not finish within {deadline_s} s"
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # a rank left waiting for a dead peer
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    if failure is not None:
        output = "\n".join(f"--- rank {r}:\n{logs[r].read_text()[-4000:]}" for r in range(world))
        failure = f"{failure}\n{output}"
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return RankRun(results, failure)


def run_checks(checks: Sequence[tuple[str, Callable[[], None]]], out: Path, rank: int) -> None:
    """Runs the checks in order, recording each; exits at the first failure (the other
    ranks may wait in a collective this one will never run: the test kills them)."""
    results: dict[str, str | None] = {}
    for name, fn in checks:
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
            out.write_text(json.dumps(results))
            print(f"rank {rank} failed at {name}:\n{results[name]}", flush=True)
            os._exit(1)
        out.write_text(json.dumps(results))


def assert_check_passed(run: RankRun, name: str) -> None:
    """Fails with every rank's error for check `name`, or with why it was not reached."""
    import pytest

    errors = [f"rank {r}:\n{res[name]}" for r, res in enumerate(run.results) if res.get(name)]
    assert not errors, "\n".join(errors)
    missed = [r for r, res in enumerate(run.results) if name not in res]
    if missed:
        stops = [next((n for n, e in res.items() if e), None) for res in run.results]
        where = ", ".join(f"rank {r} at {n}" for r, n in enumerate(stops) if n)
        pytest.fail(
            f"not reached: the run stopped ({where or 'before any check failed'}); {run.failure}",
            pytrace=False,
        )
