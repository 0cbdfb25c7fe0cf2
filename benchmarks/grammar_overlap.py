"""What a bitmask fill beside the step's Python costs the step, on this host's CPU: a
step model (start the fill of `--batch` rows, `--work` µs of Python, wait for the fill)
with the fill on a thread of this process (xgrammar's batch fill, which gives up the GIL
while it runs, on a thread woken by an event; the GIL's switch interval 20 µs, as the
fill thread had it) and in the engine's grammar process (StructuredOutputManager). Rows: the
benchmarks' array schema, inside a string. Median µs over `--steps` steps.

    python -P benchmarks/grammar_overlap.py [--batch 64] [--work 0 500 800] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

from asyncllm.bench.common import ARRAY_SCHEMA
from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_engine_config
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured.manager import StructuredOutputManager

PREFIX = '["abcdefg'  # (inside the first string: a state with many tokens to check)


def python_work(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def step_model(start: Callable[[], Callable[[], None]], work: float, steps: int) -> dict:
    starts, waits, totals = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        wait = start()
        t1 = time.perf_counter()
        python_work(work)
        t2 = time.perf_counter()
        wait()
        t3 = time.perf_counter()
        starts.append(t1 - t0)
        waits.append(t3 - t2)
        totals.append(t3 - t0)
    med = [round(statistics.median(x) * 1e6) for x in (starts, waits, totals)]
    return dict(zip(("start_us", "wait_us", "total_us"), med))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--work", type=float, nargs="+", default=[0, 500, 800])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--model", help="a model folder with its tokenizer (default: SmolLM2)")
    args = ap.parse_args()
    import sys

    import xgrammar

    sys.setswitchinterval(2e-5)
    from transformers import AutoTokenizer

    config = create_engine_config(EngineArgs(model=args.model, device="cpu", load_format="dummy"))
    vocab = int(config.model.hf_config.vocab_size)
    tok = AutoTokenizer.from_pretrained(config.model.tokenizer)
    manager = StructuredOutputManager(config.model.tokenizer, vocab, max_rows=args.batch)
    try:
        reqs = [
            manager.request(StructuredOutputsParams(json=ARRAY_SCHEMA)) for _ in range(args.batch)
        ]
        for r in reqs:
            r.future.result()
            assert r.ready()
        ids = tok.encode(PREFIX)
        local = [xgrammar.GrammarMatcher(r.future.result()) for r in reqs]
        for t in ids:
            assert not manager.accept([(i, r, t) for i, r in enumerate(reqs)])
            assert all(m.accept_token(t) for m in local)
        bitmask = manager.take_bitmask(args.batch)[1]
        rows = list(enumerate(reqs))
        batch = xgrammar.BatchGrammarMatcher(max_threads=1)

        def in_process() -> Callable[[], None]:
            job = manager.start_fill(bitmask, rows, [])
            return lambda: None if job.wait() else None

        go, done = threading.Event(), threading.Event()

        def fill_loop() -> None:  # (a thread that lives on, woken per fill)
            while True:
                go.wait()
                go.clear()
                batch.batch_fill_next_token_bitmask(local, bitmask)
                done.set()

        threading.Thread(target=fill_loop, daemon=True).start()

        def on_thread() -> Callable[[], None]:
            done.clear()
            go.set()
            return done.wait

        t0 = time.perf_counter()
        for _ in range(200):
            batch.batch_fill_next_token_bitmask(local, bitmask)
        alone = (time.perf_counter() - t0) / 200 * 1e6
        print(f"batch {args.batch}: one fill alone {alone:.0f} µs")
        out = []
        for work in args.work:
            for name, start in (("thread", on_thread), ("grammar process", in_process)):
                row = {"work_us": work, "fill": name, **step_model(start, work, args.steps)}
                out.append(row)
                print(
                    f"work {work:5.0f} µs, fill on a {name:15s}: start {row['start_us']:4d} "
                    f"wait {row['wait_us']:5d} step {row['total_us']:5d} µs"
                )
    finally:
        manager.shutdown()
    print(json.dumps({"benchmark": "grammar_overlap", "fill_alone_us": alone, "rows": out}))


if __name__ == "__main__":
    main()
