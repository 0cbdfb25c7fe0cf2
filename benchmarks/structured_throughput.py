"""Constrained against unconstrained decode throughput, output tokens per second, on the
embedded SmolLM2 (issue 15's cost target: at most 5% slower at batch 64).

Each batch size runs twice over the same prompts: once with a JSON schema (an array of
short strings, long enough that `max_tokens` ends most requests before the grammar
does) and once without constraints (EOS ignored, so both produce up to `max_tokens`).
Throughput is the output tokens produced over the wall time of `LLM.generate`, after a
warm-up pass of each kind. `--model DIR --load-format dummy` runs the same shapes with
random weights (a folder with SmolLM2's config and tokenizer is enough). `--save-tokens
FILE` writes the constrained outputs' token ids of the largest batch (for
`structured_overhead.py --paths`: the fill's cost along them).

    python benchmarks/structured_throughput.py --device cuda --dtype bfloat16 --batch 1 64
"""

from __future__ import annotations

import argparse
import json
import time

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from asyncllm.bench.common import ARRAY_SCHEMA, add_engine_args, engine_kwargs


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap, device="cuda", dtype="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--save-tokens", help="a JSON file for the constrained outputs' token ids")
    args = ap.parse_args()
    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", max(args.batch))
    llm = LLM(**kwargs)
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=ARRAY_SCHEMA),
    )
    rows = []
    try:
        for batch in args.batch:
            prompts = [f"List {batch} words about item {i}, as a JSON array:" for i in range(batch)]
            row: dict = {"batch": batch}
            for name, params in (("unconstrained", free), ("constrained", constrained)):
                run(llm, prompts, params)  # warm-up (and the grammar's compile, cached)
                outputs, wall = run(llm, prompts, params)
                tokens = sum(map(len, outputs))
                row[name] = {"tokens": tokens, "s": round(wall, 3), "tok_s": round(tokens / wall)}
                if name == "constrained" and args.save_tokens and batch == max(args.batch):
                    with open(args.save_tokens, "w") as f:
                        json.dump(outputs, f)
            row["slowdown"] = round(
                1 - row["constrained"]["tok_s"] / row["unconstrained"]["tok_s"], 4
            )
            rows.append(row)
            print(
                f"batch {batch}: unconstrained {row['unconstrained']['tok_s']} tok/s, "
                f"constrained {row['constrained']['tok_s']} tok/s "
                f"({100 * row['slowdown']:.1f}% slower)"
            )
    finally:
        llm.shutdown()
    print(json.dumps({"benchmark": "structured_throughput", "rows": rows}))


if __name__ == "__main__":
    main()
