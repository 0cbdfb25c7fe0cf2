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
    add_peak_rate_args,
    add_throughput_workload_args,
    add_warmup_arg,
    benchmark_parser,
    check_output_tokens,
    check_throughput_workload_args,
    describe_engine,
    engine_kwargs,
    format_table,
    num_warmup_requests,
    report,
    throughput_workload,
    warmup_requests,
)
from asyncllm.bench.roofline import engine_workload_floor, rates_from_args
from asyncllm.entrypoints.llm import LLM
from asyncllm.sampling_params import SamplingParams

ENGINE_DEFAULTS = {"max_model_len": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 16384}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser("throughput", __doc__, **ENGINE_DEFAULTS)
    add_throughput_workload_args(parser)
    add_warmup_arg(parser)
    add_peak_rate_args(parser)
    args = parser.parse_args(argv)
    check_throughput_workload_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompts, max_tokens, temperature = throughput_workload(args)
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens
    ]
    requests: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(**engine_kwargs(args))
    try:
        config = llm.engine.config
        engine = describe_engine(config)
        n_warm = num_warmup_requests(args, config)
        if n_warm:
            llm.generate(*warmup_requests(n_warm, temperature), use_tqdm=False)
        llm.reset_prefix_cache()
        before = llm.get_stats()
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = llm.get_stats()
    finally:
        llm.shutdown()

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    check_output_tokens(output_tokens, sum(max_tokens))
    prompt_tokens = sum(map(len, prompts))
    floor = engine_workload_floor(
        config,
        prompts,
        max_tokens,
        num_blocks=after["num_blocks"],
        rates=rates_from_args(args, engine["device_name"]),
        hybrid=not args.disable_hybrid_kv_cache_manager,
    )
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
        "steps": after["num_steps"] - before["num_steps"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "floor": floor,
    }
    rows: list[list[Any]] = [
        ["requests", len(prompts)],
        ["prompt tokens", prompt_tokens],
        ["output tokens", output_tokens],
        ["time, s", elapsed],
        ["output tok/s", result["output_tok_s"]],
        ["total tok/s", result["total_tok_s"]],
        ["steps (the plan's)", f"{result['steps']} ({floor['steps']})"],
        ["preemptions (the plan's)", f"{result['preemptions']} ({floor['preemptions']})"],
    ]
    if "serial_s" in floor:
        result["vs_serial_floor"] = floor["serial_s"] / elapsed
        result["vs_overlapped_floor"] = floor["overlapped_s"] / elapsed
        rows += [
            ["floor: serial kernels, output tok/s", floor["serial_output_tok_s"]],
            ["floor: all overlapped, output tok/s", floor["overlapped_output_tok_s"]],
            ["fraction of the serial floor", result["vs_serial_floor"]],
            ["fraction of the overlapped floor", result["vs_overlapped_floor"]],
        ]
    else:
        rows.append(["floor", "(no peak rates for this device: --hbm-bandwidth, --peak-flops)"])
    title = (
        f"throughput: {engine['model']} ({engine['architecture']}), {engine['dtype']} on "
        f"{engine['device']} ({engine['device_name']}), {args.workload} workload, temperature "
        f"{temperature}, EOS ignored"
    )
    return report(title, format_table(["figure", "value"], rows), result)


if __name__ == "__main__":
    main()
