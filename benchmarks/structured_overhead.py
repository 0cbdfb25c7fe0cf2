"""What structured outputs cost a step on the CPU, in µs: filling the token bitmask
(xgrammar matchers, one row per constrained request; in the engine core's scheduler)
and applying it to the logits (asyncllm.sample.ops.apply_token_bitmask; in the model
runner), at batch 1 and 32, the embedded SmolLM2's vocabulary, a JSON schema, matchers
advanced along a valid output (the sample text where the grammar allows it) so the
masks are those of real steps. "fill T" is the engine's (`StructuredOutputManager.
fill_bitmask`: the grammar process's fill split over at most T threads, and the round
trip to it), one grammar process for each T of `--threads` (default: the engine's
default, ASYNCLLM_GRAMMAR_THREADS); "split T" is the grammar process's code for that
(`StepThreads`) run in this process, without the round trip; "one call" fills every row
in one call to xgrammar's BatchGrammarMatcher with one thread, "xgr threads" with
xgrammar's own threads (its default count, a new pool each call; all three with matchers
of this process); "accept" is every matcher accepting its next token
(the engine's `StructuredOutputManager.accept`, in the first process: the round trip
included).

`--paths FILE` (token ids of real outputs, one list per request: what
`structured_throughput.py --save-tokens` writes) advances row i along output i instead,
for the array schema (`--schema array`, the benchmark's); the batch is the first rows.

    python benchmarks/structured_overhead.py [--batch 1 32] [--steps 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from asyncllm import envs
from asyncllm.bench.common import ARRAY_SCHEMA
from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_engine_config
from asyncllm.sample.ops import apply_token_bitmask
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured.grammar_process import StepThreads
from asyncllm.structured.manager import StructuredOutputManager

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "tags", "age"],
    "additionalProperties": False,
}
TEXT = '{"name": "Ada Lovelace", "tags": ["math", "poetry"], "age": 36}'
# --schema array: the H200 benchmarks' constraint (an array of 64 short strings)
ARRAY_TEXT = json.dumps(
    ["alpha", "beta gamma", "delta", "epsilon zeta"] * 16, separators=(",", ":")
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", help="a model folder with its tokenizer (default: SmolLM2)")
    ap.add_argument("--schema", choices=("object", "array"), default="object")
    ap.add_argument("--paths", help="a JSON file: the token ids each row's matcher follows")
    ap.add_argument("--threads", type=int, nargs="+", help="the grammar processes' threads")
    args = ap.parse_args()
    paths = None
    if args.paths:
        with open(args.paths) as f:
            paths = json.load(f)
        if max(args.batch) > len(paths):
            ap.error(
                f"--batch {max(args.batch)} is more than the {len(paths)} paths in {args.paths}"
            )
    schema, text = (SCHEMA, TEXT) if args.schema == "object" else (ARRAY_SCHEMA, ARRAY_TEXT)
    config = create_engine_config(EngineArgs(model=args.model, device="cpu", load_format="dummy"))
    vocab = int(config.model.hf_config.vocab_size)
    managers = {}  # threads -> a manager (and its grammar process)
    compile_s = 0.0
    for threads in args.threads or [envs.grammar_threads()]:
        # (a manager's process starts with its first grammar, reading the variable then)
        os.environ["ASYNCLLM_GRAMMAR_THREADS"] = str(threads)
        managers[threads] = StructuredOutputManager(config.model.tokenizer, vocab, max_rows=256)
        t0 = time.perf_counter()
        managers[threads].request(StructuredOutputsParams(json=schema)).future.result()
        compile_s = compile_s or time.perf_counter() - t0
    manager = next(iter(managers.values()))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(config.model.tokenizer)(text).input_ids
    print(f"vocabulary {vocab}; first compilation (tokenizer info included) {compile_s:.2f} s")
    fill_heads = "".join(f"{f'fill {t} µs':>12}" for t in managers)
    fill_heads += "".join(f"{f'split {t} µs':>13}" for t in managers)
    print(
        f"{'batch':>5}{fill_heads} {'one call µs':>12} {'xgr threads µs':>15} {'apply µs':>9} "
        f"{'accept µs':>10}"
    )
    import xgrammar

    one_call, threaded = xgrammar.BatchGrammarMatcher(1), xgrammar.BatchGrammarMatcher()
    splits = {t: StepThreads(t, xgrammar) for t in managers}
    rows = []
    for batch in args.batch:
        reqs_of = {
            t: [m.request(StructuredOutputsParams(json=schema)) for _ in range(batch)]
            for t, m in managers.items()
        }
        for reqs in reqs_of.values():
            for r in reqs:
                r.future.result()
                r.ready()
        reqs = reqs_of[next(iter(managers))]
        # (xgrammar's own matchers, here, for the one-call and threads columns)
        local = [xgrammar.GrammarMatcher(r.future.result()) for r in reqs]
        fills: dict[int, list[float]] = {t: [] for t in managers}
        one_calls, threaded_fills, applies, accepts = [], [], [], []
        split_fills: dict[int, list[float]] = {t: [] for t in splits}
        logits = torch.randn(batch, vocab)
        idx = torch.arange(batch)
        for step in range(args.steps):
            if local[0].is_terminated() or (paths and step >= min(map(len, paths[:batch]))):
                break
            bitmask = manager.take_bitmask(batch)[1]
            matchers = local
            for t, split in splits.items():
                t0 = time.perf_counter()
                split.run([], list(enumerate(matchers)), bitmask)
                split_fills[t].append(time.perf_counter() - t0)
            for batcher, times in ((one_call, one_calls), (threaded, threaded_fills)):
                t0 = time.perf_counter()
                batcher.batch_fill_next_token_bitmask(matchers, bitmask)
                times.append(time.perf_counter() - t0)
            for t, m in managers.items():
                own = m.take_bitmask(batch)[1]  # (each process fills its own buffers)
                t0 = time.perf_counter()
                m.fill_bitmask(own, list(enumerate(reqs_of[t])))
                fills[t].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            apply_token_bitmask(logits, idx, bitmask)
            applies.append(time.perf_counter() - t0)
            if paths:  # row i: output i's next token
                tokens = [path[step] for path in paths[:batch]]
            else:  # every row: the text's token if the grammar allows it, else the first allowed
                word = bitmask[0].tolist()
                allowed = [t for t in range(vocab) if (word[t // 32] >> (t % 32)) & 1]
                if not allowed:
                    break
                token = ids[step] if step < len(ids) and ids[step] in allowed else allowed[0]
                tokens = [token] * batch
            t0 = time.perf_counter()
            refused = manager.accept([(i, r, t) for i, (r, t) in enumerate(zip(reqs, tokens))])
            accepts.append(time.perf_counter() - t0)
            for t, m in list(managers.items())[1:]:
                refused += m.accept(
                    [(i, r, tok) for i, (r, tok) in enumerate(zip(reqs_of[t], tokens))]
                )
            assert not refused and all(m.accept_token(t) for m, t in zip(local, tokens))
        print(f"  ({len(applies)} steps)")
        fill = {t: statistics.median(times) * 1e6 for t, times in fills.items()}
        split = {t: statistics.median(times) * 1e6 for t, times in split_fills.items()}
        apply = statistics.median(applies) * 1e6
        one, many = statistics.median(one_calls) * 1e6, statistics.median(threaded_fills) * 1e6
        accept = statistics.median(accepts) * 1e6
        rows.append(
            {
                "batch": batch,
                "fill_us": fill,
                "split_us": split,
                "one_call_us": one,
                "xgrammar_threads_us": many,
                "apply_us": apply,
                "accept_us": accept,
            }
        )
        cells = "".join(f"{us:>12.1f}" for us in fill.values())
        cells += "".join(f"{us:>13.1f}" for us in split.values())
        print(f"{batch:>5}{cells} {one:>12.1f} {many:>15.1f} {apply:>9.1f} {accept:>10.1f}")
    for m in managers.values():
        m.shutdown()
    print(json.dumps({"benchmark": "structured_overhead", "vocab": vocab, "rows": rows}))


if __name__ == "__main__":
    main()
