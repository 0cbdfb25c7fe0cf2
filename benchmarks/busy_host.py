"""Decode speed on a machine that other work keeps busy: the engine core's torch threads
as torch sets them (one per core), fixed at one, and followed by the core (the default:
see `asyncllm.engine.cpu_threads`), on an idle machine and with other processes each
spinning on one core.

    python benchmarks/busy_host.py --spinners 1

Each row: one engine (the embedded SmolLM2-135M, float32, its core in its own process),
a warm-up batch that also lets the core see the machine's load, then a measured batch of
`--batch` requests of `--tokens` tokens each (EOS ignored).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

from asyncllm import LLM, SamplingParams
from asyncllm.engine.cpu_threads import available_cpus

PROMPT = "Tell me a long story about a river that flows through a valley to the sea."


def spin() -> None:
    while True:
        pass


def run(cpu_threads: int | None, args: argparse.Namespace) -> dict:
    kwargs = {} if cpu_threads is None else {"cpu_threads": cpu_threads}
    llm = LLM(device="cpu", **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        warm = time.perf_counter()
        while time.perf_counter() - warm < args.warmup_s:  # (the tuner reads 1 s windows)
            llm.generate([PROMPT] * args.batch, params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([PROMPT] * args.batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"tok_s": tokens / elapsed, "threads_after": llm.get_stats()["cpu_threads"]}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spinners", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=4.0)
    args = ap.parse_args()
    print(f"{len(available_cpus())} CPUs", flush=True)
    rows = []
    for spinners in args.spinners:
        procs = [mp.Process(target=spin, daemon=True) for _ in range(spinners)]
        for p in procs:
            p.start()
        try:
            for label, threads in (("one per CPU", 0), ("one", 1), ("followed (default)", None)):
                fixed = None if threads is None else (threads or len(available_cpus()))
                r = run(fixed, args)
                rows.append({"spinners": spinners, "threads": label, **r})
                print(
                    f"spinners {spinners}: threads {label:20s} {r['tok_s']:7.1f} tok/s "
                    f"(core ends with {r['threads_after']})",
                    flush=True,
                )
        finally:
            for p in procs:
                p.terminate()
    print(json.dumps({"benchmark": "busy_host", "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
