"""Constrained against unconstrained decode throughput, output tokens per second, on the
embedded SmolLM2 (issue 15's cost target: at most 5% slower at batch 64).

Each batch size runs twice over the same prompts: once with a JSON schema (an array of
short strings, long enough that `max_tokens` ends most requests before the grammar
does) and once without constraints (EOS ignored, so both produce up to `max_tokens`).
Throughput is the output tokens produced over the wall time of `LLM.generate`, after a
warm-up pass of each kind: the median of `--repeat` runs of each, taken in turn (free,
constrained, free, ...) so that a lent host's drift falls on both. `--model DIR --load-format dummy` runs the same shapes with
random weights (a folder with SmolLM2's config and tokenizer is enough). `--save-tokens
FILE` writes the constrained outputs' token ids of the largest batch (for
`structured_overhead.py --paths`: the fill's cost along them). With several
`--max-tokens`, each batch size runs at each, and the decode rate between the shortest
and the longest runs (their extra tokens over their extra time) leaves out what a run
pays once: its prefill, the first fill.

    python benchmarks/structured_throughput.py --device cuda --dtype bfloat16 --batch 1 64 \
        --max-tokens 64 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from asyncllm.bench.common import ARRAY_SCHEMA, add_engine_args, engine_kwargs


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], wall


def host_steps(llm: LLM, kind: str) -> None:
    """Sets the in-process core's constrained steps to host steps for `kind`
    constrained_host_steps, else back to device steps where they can run."""
    core = getattr(llm.engine.client, "core", None)  # (None: the core's own process)
    if core is not None:
        core._device_steps = False if kind == "constrained_host_steps" else None


def runs_text(rates: list[float]) -> str:
    return "(" + ", ".join(f"{r:,.0f}" for r in rates) + ")"


def measure(llm: LLM, args: argparse.Namespace, batch: int, max_tokens: int) -> dict:
    """One batch size's row: free and constrained runs in turn, after a warm-up of each."""
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=ARRAY_SCHEMA),
    )
    prompts = [f"List {batch} words about item {i}, as a JSON array:" for i in range(batch)]
    kinds = [("unconstrained", free), ("constrained", constrained)]
    if args.host_steps_too:
        kinds.append(("constrained_host_steps", constrained))
    for name, params in kinds:
        host_steps(llm, name)
        run(llm, prompts, params)  # warm-up (and the grammar's compile, cached)
    runs: dict[str, list[float]] = {name: [] for name, _ in kinds}
    walls: dict[str, list[float]] = {name: [] for name, _ in kinds}
    row: dict = {"batch": batch, "max_tokens": max_tokens}
    for _ in range(args.repeat):  # alternating, so a host's drift hits both alike
        for name, params in kinds:
            host_steps(llm, name)
            outputs, wall = run(llm, prompts, params)
            tokens = sum(map(len, outputs))
            runs[name].append(tokens / wall)
            walls[name].append(wall)
            row[name] = {"tokens": tokens}
            if name == "constrained" and args.save_tokens and batch == max(args.batch):
                with open(args.save_tokens, "w") as f:
                    json.dump(outputs, f)
    for name, rates in runs.items():
        row[name]["tok_s"] = round(statistics.median(rates))
        row[name]["runs"] = [round(r) for r in rates]
        row[name]["wall_s"] = statistics.median(walls[name])
    row["slowdown"] = round(1 - row["constrained"]["tok_s"] / row["unconstrained"]["tok_s"], 4)
    print(
        f"batch {batch}, {max_tokens} tokens: unconstrained {row['unconstrained']['tok_s']} "
        f"tok/s {runs_text(runs['unconstrained'])}, constrained {row['constrained']['tok_s']} "
        f"tok/s {runs_text(runs['constrained'])} ({100 * row['slowdown']:.1f}% slower)"
    )
    if args.host_steps_too:
        host = row["constrained_host_steps"]["tok_s"]
        slower = 1 - host / row["unconstrained"]["tok_s"]
        print(
            f"batch {batch}, {max_tokens} tokens: constrained with host steps {host} tok/s "
            f"{runs_text(runs['constrained_host_steps'])} ({100 * slower:.1f}% slower)"
        )
    return row


def decode_rates(rows: list[dict]) -> None:
    """The tokens of the longest runs beyond those of the shortest over the extra wall
    time (medians): the decode rate with what a run pays once (its prefill, the first
    fill) taken out."""
    short, long = min(rows, key=lambda r: r["max_tokens"]), max(rows, key=lambda r: r["max_tokens"])
    rates = {}
    for name in ("unconstrained", "constrained"):
        extra = long[name]["tokens"] - short[name]["tokens"]
        rates[name] = extra / (long[name]["wall_s"] - short[name]["wall_s"])
    slower = 1 - rates["constrained"] / rates["unconstrained"]
    long["decode_slowdown"] = round(slower, 4)
    print(
        f"batch {long['batch']}, tokens {short['max_tokens']} to {long['max_tokens']}: "
        f"unconstrained {rates['unconstrained']:,.0f} tok/s, constrained "
        f"{rates['constrained']:,.0f} tok/s ({100 * slower:.1f}% slower)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap, device="cuda", dtype="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument(
        "--max-tokens",
        type=int,
        nargs="+",
        default=[256],
        help="new tokens a request (several: each batch size at each; a cost paid once a "
        "run weighs less in a longer one)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each kind, alternating")
    ap.add_argument("--save-tokens", help="a JSON file for the constrained outputs' token ids")
    ap.add_argument(
        "--host-steps-too",
        action="store_true",
        help="also constrained runs with host steps (as ASYNCLLM_GRAMMAR_DEVICE_STEPS=0), "
        "in turn with the others in one engine whose core runs in this process",
    )
    args = ap.parse_args()
    kwargs = engine_kwargs(args)
    if args.host_steps_too:
        kwargs["multiprocess"] = False
    kwargs.setdefault("max_num_seqs", max(args.batch))
    llm = LLM(**kwargs)
    rows = []
    try:
        for batch in args.batch:
            for max_tokens in args.max_tokens:
                rows.append(measure(llm, args, batch, max_tokens))
            if len(args.max_tokens) > 1:
                decode_rates(rows[-len(args.max_tokens) :])
    finally:
        llm.shutdown()
    print(json.dumps({"benchmark": "structured_throughput", "rows": rows}))


if __name__ == "__main__":
    main()
