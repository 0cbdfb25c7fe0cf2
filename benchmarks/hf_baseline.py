"""transformers' own `generate` on the workloads of `asyncllm.bench`, as a baseline.

The model is built from a config folder with random weights (`from_config`), in
bfloat16 on CUDA when there is one. Two workloads:

- throughput: the workload of `python -m asyncllm.bench.throughput` (256 random
  token-id prompts, max_tokens 100-1024 each), in batches of --batch-size prompts taken
  in order, left-padded, sampled at temperature 0.6. A batch runs until its longest
  request is done (min_new_tokens = max_new_tokens, so EOS never ends it early); only
  each request's own max_tokens count as useful output.
- latency: batch 1, the 128-token prompt of `python -m asyncllm.bench.latency`, 512
  greedy tokens; tok/s = 512 / wall time of one `generate` (median of --iters).

    python benchmarks/hf_baseline.py --model benchmarks/configs/qwen3-0.6b --workload both
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from asyncllm.bench.common import NUM_PROMPTS, format_table, make_workload, report
from asyncllm.bench.latency import latency_prompt

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/hf_baseline.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--workload", choices=["throughput", "latency", "both"], default="both")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0, help="the weights' and the workload's seed")
    g = ap.add_argument_group("throughput")
    g.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    g.add_argument("--max-input-len", type=int, default=1024)
    g.add_argument("--max-output-len", type=int, default=1024)
    g.add_argument("--batch-size", type=int, default=64, help="prompts per generate call")
    g.add_argument("--temperature", type=float, default=0.6)
    g = ap.add_argument_group("latency")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=512)
    g.add_argument("--iters", type=int, default=3)
    return ap.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model: Any, prompts: list[list[int]], new_tokens: int, **sampling: Any) -> int:
    """One left-padded batch; returns the number of new tokens per row."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **sampling,
        )
    return out.shape[1] - width


def run_throughput(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    prompts, max_tokens = make_workload(
        args.num_prompts, args.seed, args.max_input_len, args.max_output_len
    )
    device = next(model.parameters()).device
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": 1.0, "top_k": 0}
    generate(model, [prompts[0][:32]], 8, **sampling)  # warm-up
    generated = 0
    sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        batch, wants = prompts[i : i + args.batch_size], max_tokens[i : i + args.batch_size]
        n = generate(model, batch, max(wants), **sampling)
        assert n == max(wants), f"generate made {n} tokens, not {max(wants)}"
        generated += n * len(batch)
    sync(device)
    elapsed = time.perf_counter() - start
    useful = sum(max_tokens)
    prompt_tokens = sum(map(len, prompts))
    return {
        "num_prompts": len(prompts),
        "batch_size": args.batch_size,
        "prompt_tokens": prompt_tokens,
        "output_tokens": useful,
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "output_tok_s": useful / elapsed,
        "total_tok_s": (prompt_tokens + useful) / elapsed,
    }


def run_latency(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    prompt = latency_prompt(args.input_len)
    device = next(model.parameters()).device

    def timed() -> float:
        sync(device)
        start = time.perf_counter()
        n = generate(model, [prompt], args.output_len, do_sample=False)
        sync(device)
        assert n == args.output_len
        return time.perf_counter() - start

    timed()  # warm-up
    walls = [timed() for _ in range(args.iters)]
    wall = statistics.median(walls)
    return {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "wall_s": wall,
        "wall_s_all": walls,
        "tok_s": args.output_len / wall,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype])
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # EOS off, as in asyncllm.bench

    result: dict[str, Any] = {
        "benchmark": "hf_baseline",
        "model": args.model,
        "dtype": args.dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    rows = []
    if args.workload in ("throughput", "both"):
        t = result["throughput"] = run_throughput(model, args)
        rows.append(
            ["throughput", f"{t['num_prompts']} prompts", t["output_tok_s"], t["elapsed_s"]]
        )
    if args.workload in ("latency", "both"):
        lat = result["latency"] = run_latency(model, args)
        rows.append(
            [
                "latency",
                f"batch 1, {args.input_len} + {args.output_len}",
                lat["tok_s"],
                lat["wall_s"],
            ]
        )
    title = f"transformers generate: {args.model}, {args.dtype} on {result['device_name']}"
    table = format_table(["workload", "shape", "output tok/s", "time s"], rows)
    return report(title, table, result)


if __name__ == "__main__":
    main()
