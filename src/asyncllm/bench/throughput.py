"""Offline throughput: one LLM.generate over a workload, after a warm-up (on CUDA,
max_num_seqs short requests ending one a step, so the kernels of every batch shape are
compiled before the clock starts). Reported: output tokens/s and total (prompt +
output) tokens/s. EOS is ignored. `--workload`:

- nano-vllm (the default): 256 prompts of 100-1024 random token ids, each with its own
  max_tokens of 100-1024 (temperature 0.6: 133,966 output tokens in all).
- prefill: 256 distinct prompts of 3,000 random ids, 16 greedy tokens each (the prompt
  tokens dominate; `--prompt-len`, `--output-len` and `--num-prompts` scale it).
- shared-prefix: 512 prompts of one 2,048-id prefix and 64 ids of their own, 64 greedy
  tokens each (the prefix cache's workload; `--prompt-len` is the prefix's length).

    python -m asyncllm.bench.throughput --model benchmarks/configs/qwen3-0.6b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 [--workload prefill]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from asyncllm.bench.common import (
    FIXED_WORKLOADS,
    NUM_PROMPTS,
    add_engine_args,
    add_warmup_arg,
    add_workload_args,
    check_output_tokens,
    describe_engine,
    engine_kwargs,
    format_table,
    make_fixed_workload,
    num_warmup_requests,
    report,
    warmup_requests,
    workload_from_args,
)
from asyncllm.entrypoints.llm import LLM
from asyncllm.sampling_params import SamplingParams

ENGINE_DEFAULTS = {"max_model_len": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 16384}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asyncllm.bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser, **ENGINE_DEFAULTS)
    add_workload_args(
        parser,
        "--num-prompts",
        None,
        f"how many prompts (default: the workload's, {NUM_PROMPTS} for nano-vllm's)",
    )
    g = parser.add_argument_group("fixed workloads")
    g.add_argument(
        "--workload",
        choices=["nano-vllm", *FIXED_WORKLOADS],
        default="nano-vllm",
        help="which workload (default nano-vllm's; see above)",
    )
    g.add_argument("--prompt-len", type=int, default=None, help="prefill / shared-prefix: ids")
    g.add_argument("--output-len", type=int, default=None, help="prefill / shared-prefix: tokens")
    add_warmup_arg(parser)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default 0.6 for nano-vllm's workload, 0 for the others)",
    )
    args = parser.parse_args(argv)
    if args.workload == "nano-vllm" and (args.prompt_len or args.output_len):
        parser.error(
            "--prompt-len and --output-len are for the prefill and shared-prefix workloads"
        )
    return args


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int], float]:
    """(prompts, max_tokens, temperature) of the workload the arguments name."""
    if args.workload == "nano-vllm":
        prompts, max_tokens = workload_from_args(args, args.num_prompts or NUM_PROMPTS)
        temperature = 0.6
    else:
        prompts, max_tokens, temperature = make_fixed_workload(
            args.workload,
            args.num_prompts,
            args.prompt_len,
            args.output_len,
            seed=args.seed,
            max_token_id=args.max_token_id,
        )
    return prompts, max_tokens, temperature if args.temperature is None else args.temperature


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompts, max_tokens, temperature = workload(args)
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens
    ]
    requests: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(**engine_kwargs(args))
    try:
        engine = describe_engine(llm.engine.config)
        n_warm = num_warmup_requests(args, llm.engine.config)
        if n_warm:
            llm.generate(*warmup_requests(n_warm, temperature), use_tqdm=False)
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    check_output_tokens(output_tokens, sum(max_tokens))
    prompt_tokens = sum(map(len, prompts))
    result = {
        "benchmark": "throughput",
        "engine": engine,
        "workload": args.workload,
        "temperature": temperature,
        "num_prompts": len(prompts),
        "warmup_requests": n_warm,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "requests_per_s": len(prompts) / elapsed,
    }
    table = format_table(
        ["requests", "prompt tok", "output tok", "time s", "output tok/s", "total tok/s"],
        [
            [
                len(prompts),
                prompt_tokens,
                output_tokens,
                elapsed,
                result["output_tok_s"],
                result["total_tok_s"],
            ]
        ],
    )
    title = (
        f"throughput: {engine['model']} ({engine['architecture']}), {engine['dtype']} on "
        f"{engine['device']} ({engine['device_name']}), {args.workload} workload, temperature "
        f"{temperature}, EOS ignored"
    )
    return report(title, table, result)


if __name__ == "__main__":
    main()
