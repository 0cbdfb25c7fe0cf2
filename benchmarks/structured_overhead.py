"""What structured outputs cost a step on the CPU, in µs: filling the token bitmask
(xgrammar matchers, one row per constrained request; in the engine core's scheduler)
and applying it to the logits (asyncllm.sample.ops.apply_token_bitmask; in the model
runner), at batch 1 and 32, the embedded SmolLM2's vocabulary, a JSON schema, matchers
advanced along a valid output (the sample text where the grammar allows it) so the
masks are those of real steps. "fill" is the engine's (`StructuredOutputManager.
fill_bitmask`: one xgrammar call in the grammar process, ASYNCLLM_GRAMMAR_THREADS threads,
and the round trip to it); "one call" fills
every row in one call to xgrammar's BatchGrammarMatcher with one thread, "threads" with
its default thread count (both with matchers of this process); "accept" is every matcher
accepting its next token (the engine's `StructuredOutputManager.accept`: one call in the
grammar process and the round trip).

`--paths FILE` (token ids of real outputs, one list per request: what
`structured_throughput.py --save-tokens` writes) advances row i along output i instead,
for the array schema (`--schema array`, the benchmark's); the batch is the first rows.

    python benchmarks/structured_overhead.py [--batch 1 32] [--steps 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asyncllm.bench.common import ARRAY_SCHEMA
from asyncllm.config import EngineArgs
from asyncllm.engine.arg_utils import create_engine_config
from asyncllm.sample.ops import apply_token_bitmask
from asyncllm.sampling_params import StructuredOutputsParams
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
    manager = StructuredOutputManager(config.model.tokenizer, vocab)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(config.model.tokenizer)(text).input_ids
    t0 = time.perf_counter()
    first = manager.request(StructuredOutputsParams(json=schema))
    first.future.result()
    compile_s = time.perf_counter() - t0
    print(f"vocabulary {vocab}; first compilation (tokenizer info included) {compile_s:.2f} s")
    print(
        f"{'batch':>5} {'fill µs':>9} {'one call µs':>12} {'threads µs':>11} {'apply µs':>9} "
        f"{'accept µs':>10} {'fill µs/row':>12}"
    )
    import xgrammar

    one_call, threaded = xgrammar.BatchGrammarMatcher(1), xgrammar.BatchGrammarMatcher()
    rows = []
    for batch in args.batch:
        reqs = [manager.request(StructuredOutputsParams(json=schema)) for _ in range(batch)]
        for r in reqs:
            r.future.result()
            r.ready()
        # (xgrammar's own matchers, here, for the one-call and threads columns)
        local = [xgrammar.GrammarMatcher(r.future.result()) for r in reqs]
        fills, one_calls, threaded_fills, applies, accepts = [], [], [], [], []
        logits = torch.randn(batch, vocab)
        idx = torch.arange(batch)
        for step in range(args.steps):
            if local[0].is_terminated() or (paths and step >= min(map(len, paths[:batch]))):
                break
            bitmask = manager.allocate_bitmask(batch)
            matchers = local
            for batcher, times in ((one_call, one_calls), (threaded, threaded_fills)):
                t0 = time.perf_counter()
                batcher.batch_fill_next_token_bitmask(matchers, bitmask)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            manager.fill_bitmask(bitmask, list(enumerate(reqs)))
            fills.append(time.perf_counter() - t0)
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
            assert not refused and all(m.accept_token(t) for m, t in zip(local, tokens))
        print(f"  ({len(fills)} steps)")
        fill, apply = statistics.median(fills) * 1e6, statistics.median(applies) * 1e6
        one, many = statistics.median(one_calls) * 1e6, statistics.median(threaded_fills) * 1e6
        accept = statistics.median(accepts) * 1e6
        rows.append(
            {
                "batch": batch,
                "fill_us": fill,
                "one_call_us": one,
                "threads_us": many,
                "apply_us": apply,
                "accept_us": accept,
            }
        )
        print(
            f"{batch:>5} {fill:>9.1f} {one:>12.1f} {many:>11.1f} {apply:>9.1f} "
            f"{accept:>10.1f} {fill / batch:>12.1f}"
        )
    manager.shutdown()
    print(json.dumps({"benchmark": "structured_overhead", "vocab": vocab, "rows": rows}))


if __name__ == "__main__":
    main()
