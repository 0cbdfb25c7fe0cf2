"""Speculative decoding (prompt lookup) on and off: decode tok/s and the acceptance rate,
per workload and batch size, on a model with real weights (drafts from random weights
mean nothing) and its tokenizer.

Workloads, greedy, `--output-len` tokens each (EOS ignored, so both engines produce the
same number of tokens):
- grounded: the model is asked (as a chat turn) to repeat a passage of Python source
  or prose from the standard library with one small change: most of its output is in
  its prompt already;
- open: open chat questions, whose answers are not;
- long: as grounded, with the passage (a function) inside `--long-chars` characters of
  the standard library's sources (about 6k tokens for SmolLM2 by default) given
  before it: the context an agent editing a file has, where each verification's
  attention reads thousands of keys.

For each batch size B the first B prompts of a workload (cycled) are generated in one
call; decode tok/s = (B x (output_len - 1)) / (wall - prefill), where prefill is the
same call with max_tokens=1 (both medians of --iters calls). Speculation is on for the
second engine only; requests admitted while `--disable-by-batch-size` or more are in
the engine do not speculate (so a large batch measures that cut-off). The two engines
run one after the other, never at once. The outputs are compared: with speculation on
they must be the same (greedy; DESIGN's tie rule aside).

    python -m asyncllm.bench.spec --batch-sizes 1 8 64 --output-len 128
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from typing import Any

from asyncllm.bench.common import (
    benchmark_parser,
    describe_engine,
    engine_kwargs,
    format_table,
    report,
)
from asyncllm.entrypoints.llm import LLM
from asyncllm.sampling_params import SamplingParams

OPEN_QUESTIONS = [
    "Give me three tips for writing clear Python code.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a hash table is to a beginner.",
    "Suggest a name for a coffee shop and explain it.",
    "How do I make a good cup of tea?",
    "What are the benefits of regular exercise?",
]


def _passages() -> list[tuple[str, str]]:
    """(what it is, the passage): functions' sources and modules' docstrings of the
    standard library, so the workload needs no download."""
    import shlex
    import string
    import textwrap

    funcs = [
        textwrap.dedent,
        textwrap.indent,
        shlex.quote,
        string.capwords,
        textwrap.shorten,
        shlex.split,
    ]
    out = [("Python function", inspect.getsource(f)[:1500]) for f in funcs]  # type: ignore[arg-type]
    for mod in (textwrap, shlex, string):
        out.append(("text", (mod.__doc__ or "").strip()[:1200]))
    return out


def _long_context(chars: int) -> str:
    """`chars` characters of standard-library module sources, one after another."""
    import shlex
    import string
    import textwrap

    text = "\n\n".join(inspect.getsource(m) for m in (textwrap, shlex, string, inspect))
    return text[:chars]


def workload_messages(name: str, long_chars: int = 20_000) -> list[list[dict[str, str]]]:
    if name == "open":
        return [[{"role": "user", "content": q}] for q in OPEN_QUESTIONS]
    changes = ["a comment line at the top that says 'edited'", "the first word in capitals"]
    if name == "long":
        context = _long_context(long_chars)
        return [
            [
                {
                    "role": "user",
                    "content": f"Here is some Python source.\n\n{context}\n\nRepeat the "
                    f"following {kind} exactly as it is, changing only {changes[i % 2]}."
                    f"\n\n{text}",
                }
            ]
            for i, (kind, text) in enumerate(_passages()[:6])
        ]
    return [
        [
            {
                "role": "user",
                "content": f"Repeat the following {kind} exactly as it is, changing only "
                f"{changes[i % 2]}.\n\n{text}",
            }
        ]
        for i, (kind, text) in enumerate(_passages())
    ]


def _ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser("spec", __doc__)
    g = parser.add_argument_group("speculation and workload")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="k (default 4)")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="default 2")
    g.add_argument("--prompt-lookup-max", type=int, default=5, help="default 5")
    g.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="default: the engine's (8)"
    )
    g.add_argument(
        "--workloads",
        nargs="+",
        default=["grounded", "open"],
        choices=["grounded", "open", "long"],
    )
    g.add_argument(
        "--long-chars",
        type=int,
        default=20_000,
        help="characters of source before the passage in the long workload (default 20000)",
    )
    g.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    g.add_argument("--output-len", type=int, default=128, help="tokens per request (default 128)")
    g.add_argument(
        "--iters", type=int, default=1, help="timed calls; the median counts (default 1)"
    )
    args = parser.parse_args(argv)
    if args.output_len < 2 or args.iters < 1 or min(args.batch_sizes) < 1:
        parser.error("--output-len must be at least 2, --iters and batch sizes at least 1")
    if args.long_chars < 1:
        parser.error("--long-chars must be at least 1")
    if args.skip_tokenizer_init:
        parser.error("this benchmark needs the model's tokenizer (its prompts are text)")
    return args


def _measure(llm: LLM, prompts: list[Any], output_len: int, iters: int) -> dict[str, Any]:
    def call(max_tokens: int) -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    call(output_len)  # (warm-up)
    before = llm.get_stats()
    walls: list[float] = []
    tokens: list[list[int]] = []
    for _ in range(iters):
        wall, tokens = call(output_len)
        walls.append(wall)
    after = llm.get_stats()
    prefill = statistics.median(call(1)[0] for _ in range(iters))
    wall = statistics.median(walls)
    drafts = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    verifications = after["spec_num_drafts"] - before["spec_num_drafts"]
    return {
        "wall_s": wall,
        "prefill_s": prefill,
        "decode_tok_s": len(prompts) * (output_len - 1) / max(wall - prefill, 1e-9),
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_per_verification": accepted / verifications if verifications else 0.0,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cases = [(w, b) for w in args.workloads for b in args.batch_sizes]
    messages = {w: workload_messages(w, args.long_chars) for w in args.workloads}
    results: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    engine: dict[str, Any] = {}
    for label in ("off", "on"):
        kw = engine_kwargs(args)
        if label == "on":
            spec: dict[str, Any] = {
                "method": "ngram",
                "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max,
            }
            if args.disable_by_batch_size is not None:
                spec["disable_by_batch_size"] = args.disable_by_batch_size
            kw["speculative_config"] = spec
        llm = LLM(**kw)
        try:
            engine = describe_engine(llm.engine.config)
            tok = llm.get_tokenizer()
            prompts = {
                w: [{"prompt_token_ids": _ids(tok, m)} for m in ms] for w, ms in messages.items()
            }
            room = llm.engine.config.max_model_len - args.output_len
            longest = max(len(p["prompt_token_ids"]) for ps in prompts.values() for p in ps)
            if longest > room:
                raise SystemExit(
                    f"a prompt has {longest} tokens, more than max_model_len less "
                    f"--output-len ({room}): lower --long-chars"
                )
            results[label] = {}
            for w, b in cases:
                batch = [prompts[w][i % len(prompts[w])] for i in range(b)]
                results[label][(w, b)] = _measure(llm, batch, args.output_len, args.iters)
        finally:
            llm.shutdown()
    rows, cells = [], []
    for w, b in cases:
        off, on = results["off"][(w, b)], results["on"][(w, b)]
        same = sum(x == y for x, y in zip(off["tokens"], on["tokens"]))
        cell = {
            "workload": w,
            "batch": b,
            "off_decode_tok_s": off["decode_tok_s"],
            "on_decode_tok_s": on["decode_tok_s"],
            "speedup": on["decode_tok_s"] / off["decode_tok_s"],
            "acceptance_rate": on["acceptance_rate"],
            "mean_accepted_per_verification": on["mean_accepted_per_verification"],
            "same_outputs": same,
        }
        cells.append(cell)
        rows.append([w, b, off["decode_tok_s"], on["decode_tok_s"], cell["speedup"],
                     on["acceptance_rate"], on["mean_accepted_per_verification"], f"{same}/{b}"])  # fmt: skip
    result = {
        "benchmark": "spec",
        "engine": engine,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
        "output_len": args.output_len,
        "cases": cells,
    }
    table = format_table(
        [
            "workload",
            "batch",
            "off tok/s",
            "on tok/s",
            "speed-up",
            "accepted",
            "per verify",
            "same",
        ],  # fmt: skip
        rows,
    )
    return report(
        f"speculative decoding (ngram, k={args.num_speculative_tokens}), decode tok/s",
        table,
        result,
    )


if __name__ == "__main__":
    main()
