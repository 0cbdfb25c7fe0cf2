"""Start-up by stage, in a fresh interpreter: `from asyncllm import AsyncLLM` (no torch,
no transformers: the host never imports them), then `AsyncLLM.start()` inside a running
event loop, then one short request.

Stages: the import; the engine-core process from spawn to its resolved configuration
(its imports, resolving the model); the wait for the tokenizer process (spawned once the
configuration names the tokenizer, it loads while the core loads the model: the wait is
what it takes beyond the core); the core's own stages as it reports them (its engine
config, loading the weights, the memory profile, the KV cache, CUDA graphs, the rest of
`EngineCore()`) and the remainder (the process's start, its imports, the messages); then
the first request's time to its first token and to its end. The loop's lag during
`start()` is the overshoot of a 1 ms ticker (p99 and max).

A warm start finds the converted model in `ASYNCLLM_CACHE`; `--cold` gives the child an
empty cache folder, so the embedded GGUF (or a hub download) is converted first.

    python -m asyncllm.bench.startup            # the embedded model on the CPU, warm
    python -m asyncllm.bench.startup --cold
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from asyncllm import envs

CHILD_FLAG = "--child"
TOKENIZER_WAIT = "host: tokenizer process, waited for after the core"


def _child(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Runs in the fresh interpreter: returns the stages (seconds) and the lag."""
    t0 = time.perf_counter()
    import asyncio

    from asyncllm import AsyncLLM, SamplingParams  # (as an application does, at its top)
    from asyncllm.bench.host import LoopLag
    from asyncllm.engine.tokenizer_process import ProcessTokenizer

    stages: dict[str, float] = {"from asyncllm import AsyncLLM": time.perf_counter() - t0}
    _time_calls(ProcessTokenizer, "wait_ready", TOKENIZER_WAIT, stages)
    lag = LoopLag()

    async def main() -> None:
        async with lag:
            t = time.perf_counter()
            llm = AsyncLLM(**kwargs)
            await llm.start()
            stages["AsyncLLM.start()"] = time.perf_counter() - t
        assert llm.client is not None and llm.client.info is not None
        core = dict(llm.client.info.startup_seconds)
        ready = stages["AsyncLLM.start()"] - stages.get(TOKENIZER_WAIT, 0.0)
        stages.update(core)
        stages["core: process start, imports, messages"] = ready - sum(core.values())
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        first = None
        async for _ in llm.generate([1, 2, 3, 4], params):  # (ids: any model, no tokenizer)
            first = first or time.perf_counter() - t
        stages["first request: first token"] = first or 0.0
        stages["first request: 16 tokens"] = time.perf_counter() - t
        await llm.shutdown()

    asyncio.run(main())
    return {"stages": stages, "loop_lag_ms_p99": lag.p99_ms(), "loop_lag_ms_max": lag.max_ms()}


def _time_calls(owner: Any, name: str, stage: str, stages: dict[str, float]) -> None:
    fn = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stages[stage] = stages.get(stage, 0.0) + time.perf_counter() - t

    setattr(owner, name, timed)


def run_once(kwargs: dict[str, Any], cache: str | None = None) -> dict[str, Any]:
    """One start in a fresh interpreter (`cache`: its ASYNCLLM_CACHE); the child's result."""
    env = dict(os.environ)
    if cache is not None:
        env.update(envs.cache_env(cache))
    cmd = [sys.executable, "-m", "asyncllm.bench.startup", CHILD_FLAG, json.dumps(kwargs)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the start-up child failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - t
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [CHILD_FLAG]:
        out = _child(json.loads(argv[1]))
        print(json.dumps(out), flush=True)
        return out
    from asyncllm.bench.common import add_engine_args, engine_kwargs, format_table, report

    parser = argparse.ArgumentParser(
        prog="python -m asyncllm.bench.startup",
        description=__doc__.split("\n\n")[0],
    )
    add_engine_args(parser)
    parser.add_argument("--cold", action="store_true", help="also a first start, empty cache")
    args = parser.parse_args(argv)
    kwargs = engine_kwargs(args)
    runs = {}
    if args.cold:
        with tempfile.TemporaryDirectory() as empty:
            runs["first start"] = run_once(kwargs, empty)
    runs["warm start"] = run_once(kwargs)
    names: list[str] = []
    for r in runs.values():
        names += [n for n in r["stages"] if n not in names]
    rows = [[n, *(r["stages"].get(n, float("nan")) for r in runs.values())] for n in names]
    rows.append(
        ["loop lag during start(), ms: p99", *(r["loop_lag_ms_p99"] for r in runs.values())]
    )
    rows.append(
        ["loop lag during start(), ms: max", *(r["loop_lag_ms_max"] for r in runs.values())]
    )
    table = format_table(["stage, s", *runs], rows)
    return report("start-up: " + ", ".join(runs), table, {"benchmark": "startup", "runs": runs})


if __name__ == "__main__":
    main()
