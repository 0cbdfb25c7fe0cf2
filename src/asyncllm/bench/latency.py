"""Batch-1 latency: one request, a 128-token prompt, 512 greedy output tokens (EOS ignored).

tokens/s = output_len / the wall time of one LLM.generate call (prefill included), the
median of --iters calls after a warm-up. A second series with max_tokens=1 measures the
prefill, so decode time per token = (wall - prefill) / (output_len - 1). The floor is
what memory bandwidth allows: each decode step reads every weight but the embedding
table (a tied LM head counted once) and the KV cache at the average context length,
input_len + output_len / 2, at --hbm-bandwidth bytes/s.

    python -m asyncllm.bench.latency --model benchmarks/configs/qwen3-0.6b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from asyncllm.bench.common import (
    MAX_TOKEN_ID,
    benchmark_parser,
    check_output_tokens,
    describe_engine,
    engine_kwargs,
    format_table,
    report,
)
from asyncllm.bench.roofline import DTYPE_BYTES, H200_HBM_BYTES_PER_S, ModelShape, decode_floor
from asyncllm.entrypoints.llm import LLM
from asyncllm.sampling_params import SamplingParams


def latency_prompt(
    input_len: int = 128, seed: int = 1, max_token_id: int = MAX_TOKEN_ID
) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(0, max_token_id) for _ in range(input_len)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser("latency", __doc__)
    g = parser.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    g.add_argument("--output-len", type=int, default=512, help="output tokens (default 512)")
    g.add_argument(
        "--iters", type=int, default=3, help="timed calls; the median counts (default 3)"
    )
    g.add_argument("--warmup-iters", type=int, default=1, help="untimed calls first (default 1)")
    g.add_argument("--seed", type=int, default=1, help="the prompt's random seed (default 1)")
    g.add_argument(
        "--max-token-id",
        type=int,
        default=MAX_TOKEN_ID,
        help=f"prompt ids are drawn from [0, this] (default {MAX_TOKEN_ID})",
    )
    g.add_argument(
        "--hbm-bandwidth",
        type=float,
        default=H200_HBM_BYTES_PER_S,
        help=f"memory bandwidth for the floor, bytes/s (default {H200_HBM_BYTES_PER_S:g}: H200)",
    )
    args = parser.parse_args(argv)
    if args.input_len < 1 or args.output_len < 1 or args.iters < 1 or args.warmup_iters < 0:
        parser.error("--input-len, --output-len and --iters must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompt = latency_prompt(args.input_len, args.seed, args.max_token_id)
    request: list[Any] = [{"prompt_token_ids": prompt}]

    llm = LLM(**engine_kwargs(args))

    def timed(max_tokens: int) -> float:
        if not llm.reset_prefix_cache():  # every call prefills the whole prompt
            raise RuntimeError("the prefix cache could not be emptied (blocks still held)")
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        start = time.perf_counter()
        out = llm.generate(request, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        check_output_tokens(len(out[0].outputs[0].token_ids), max_tokens)
        return elapsed

    try:
        config = llm.engine.config
        engine = describe_engine(config)
        for _ in range(args.warmup_iters):
            timed(args.output_len)
            timed(1)
        full = [timed(args.output_len) for _ in range(args.iters)]
        prefill = [timed(1) for _ in range(args.iters)]
    finally:
        llm.shutdown()

    wall, prefill_s = statistics.median(full), statistics.median(prefill)
    decode_s = (wall - prefill_s) / (args.output_len - 1) if args.output_len > 1 else float("nan")
    shape = ModelShape.from_hf_config(config.hf_config)
    dtype_bytes = DTYPE_BYTES[config.dtype]
    floor = decode_floor(shape, dtype_bytes, args.input_len, args.output_len, args.hbm_bandwidth)
    decode_tok_s = 1.0 / decode_s if decode_s > 0 else float("nan")
    result = {
        "benchmark": "latency",
        "engine": engine,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "iters": args.iters,
        "wall_s": wall,
        "wall_s_all": full,
        "tok_s": args.output_len / wall,
        "prefill_ms": prefill_s * 1e3,
        "prefill_ms_all": [t * 1e3 for t in prefill],
        "decode_ms_per_token": decode_s * 1e3,
        "decode_tok_s": decode_tok_s,
        "parameters": shape.parameter_counts()["total"],
        "streamed_parameters": shape.streamed_parameters(),
        "dtype_bytes": dtype_bytes,
        "floor": floor,
        "decode_vs_floor": decode_tok_s / floor["floor_tok_s"],
        "tok_s_vs_floor": (args.output_len / wall) / floor["floor_tok_s"],
    }
    table = format_table(
        ["figure", "value"],
        [
            ["tok/s (output_len / wall, prefill included)", result["tok_s"]],
            ["wall per call, ms (median)", wall * 1e3],
            ["prefill, ms (median of max_tokens=1)", result["prefill_ms"]],
            ["decode, ms per token", result["decode_ms_per_token"]],
            ["decode tok/s", decode_tok_s],
            ["bytes per decode step, MB", floor["bytes_per_step"] / 1e6],
            ["floor, ms per token", floor["floor_ms_per_token"]],
            ["floor tok/s", floor["floor_tok_s"]],
            ["decode tok/s / floor", result["decode_vs_floor"]],
        ],
    )
    title = (
        f"latency: {engine['model']} ({engine['architecture']}), {engine['dtype']} on "
        f"{engine['device']} ({engine['device_name']}), batch 1, {args.input_len} + "
        f"{args.output_len} tokens, greedy, floor at {args.hbm_bandwidth:g} B/s"
    )
    return report(title, table, result)


if __name__ == "__main__":
    main()
