"""Offline throughput: LLM.generate against transformers' generate on the same prompts.

Both run in this process, on the CPU, in float32, with EOS ignored so both produce
exactly the asked number of tokens. transformers runs all prompts as one left-padded
batch until the longest request ends; asyncllm schedules them continuously. The figure
is useful output tokens per second (tokens past a request's own max_tokens do not count).

    OMP_NUM_THREADS=2 python benchmarks/cpu_throughput.py --scenario both
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from asyncllm import LLM, SamplingParams

TEXT = (
    "The river wound through the valley, past farms and villages, carrying boats loaded with "
    "grain and timber towards the sea. Every spring the snow melted in the mountains and the "
    "water rose, and the people of the valley watched the banks and told stories of floods. "
)


def make_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    ids = tokenizer(TEXT * 20).input_ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def run_ours(llm: LLM, prompts, max_tokens: list[int]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    return elapsed


def run_hf(model, tokenizer, prompts, max_tokens: list[int]) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # EOS off, as on our side
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(max_tokens),
                do_sample=False,
                pad_token_id=pad,
            )
        return time.perf_counter() - start
    finally:
        model.generation_config.eos_token_id = saved


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", choices=["fixed", "varied", "both"], default="both")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    llm = LLM(device="cpu")
    tok = llm.get_tokenizer()
    ref = AutoModelForCausalLM.from_pretrained(
        llm.engine.config.model_path, dtype=torch.float32
    ).eval()
    scenarios = []
    if args.scenario in ("fixed", "both"):
        scenarios.append(
            ("8 prompts x 64 tokens", make_prompts(tok, 8, args.prompt_len, 1), [64] * 8)
        )
    if args.scenario in ("varied", "both"):
        rng = random.Random(2)
        scenarios.append(
            (
                "32 prompts x 16-128 tokens",
                make_prompts(tok, 32, args.prompt_len, 3),
                [rng.randint(16, 128) for _ in range(32)],
            )
        )
    run_ours(llm, scenarios[0][1][:2], [4, 4])  # warm-up
    rows = []
    for name, prompts, max_tokens in scenarios:
        useful = sum(max_tokens)
        t_ours = min(run_ours(llm, prompts, max_tokens) for _ in range(args.repeats))
        t_hf = min(run_hf(ref, tok, prompts, max_tokens) for _ in range(args.repeats))
        rows.append(
            {
                "scenario": name,
                "useful_tokens": useful,
                "asyncllm_tok_s": useful / t_ours,
                "transformers_tok_s": useful / t_hf,
                "ratio": t_hf / t_ours,
            }
        )
    print(
        f"threads={torch.get_num_threads()}, float32, prompt {args.prompt_len} tokens, EOS ignored"
    )
    print(f"{'scenario':<28} {'asyncllm tok/s':>15} {'transformers tok/s':>19} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['scenario']:<28} {r['asyncllm_tok_s']:>15.1f} {r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f}"
        )
    print(
        json.dumps(
            {"benchmark": "cpu_throughput", "threads": torch.get_num_threads(), "rows": rows}
        )
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
