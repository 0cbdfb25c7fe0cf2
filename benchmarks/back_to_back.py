"""Bursts sent back to back: the wall time of `LLM.generate` for `--batch` prompts of
`--max-tokens` new tokens each, the next burst sent as soon as one returns (what an
idle core does between bursts shows here), free and constrained (the array schema) in
turn; the median of `--repeat` bursts of each.

    python benchmarks/back_to_back.py --device cpu --model DIR --load-format dummy --batch 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from asyncllm.bench.common import ARRAY_SCHEMA, add_engine_args, engine_kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap, device="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    kinds = {
        "free": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
        "constrained": SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=ARRAY_SCHEMA),
        ),
    }
    prompts = [f"List words about item {i}, as a JSON array:" for i in range(args.batch)]
    walls: dict[str, list[float]] = {name: [] for name in kinds}
    with LLM(**engine_kwargs(args)) as llm:
        for params in kinds.values():  # warm-up (and the grammar's compile)
            llm.generate(prompts, params, use_tqdm=False)
        for _ in range(args.repeat):
            for name, params in kinds.items():
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                walls[name].append(time.perf_counter() - t0)
    row = {name: round(1e3 * statistics.median(w), 1) for name, w in walls.items()}
    print(f"batch {args.batch}, {args.max_tokens} new tokens: median ms a burst {row}")
    for name, w in walls.items():
        print(f"  {name}: " + ", ".join(f"{1e3 * x:.1f}" for x in w))
    print(json.dumps({"benchmark": "back_to_back", "batch": args.batch, "ms": row}))


if __name__ == "__main__":
    main()
