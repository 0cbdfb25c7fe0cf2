"""Decode throughput of the model layer over the paged cache, against transformers.

Greedy decode of `--tokens` tokens for batches of `--batch` prompts of `--prompt-len`
tokens, with the embedded SmolLM2 (or `--model`), timed after one warm-up run.
Prints a table and one JSON line.

    python benchmarks/model_decode.py --batch 1 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.registry import select_attention_backend
from asyncllm.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' hand-driven decoder)
from tests.model.paged_decoder import PagedDecoder  # noqa: E402


def ours_decode(model, backend, prompts, tokens) -> float:
    dec = PagedDecoder(
        model, backend, num_blocks=len(prompts) * (-(-(len(prompts[0]) + tokens) // 16)) + 1
    )
    sids = [dec.add_sequence() for _ in prompts]
    logits = dec.step(dict(zip(sids, prompts)))
    sync(model)
    start = time.perf_counter()
    for _ in range(tokens):
        nxt = {sid: [int(logits[sid][-1].argmax())] for sid in sids}
        logits = dec.step(nxt)
    sync(model)
    return time.perf_counter() - start


def hf_decode(ref, prompts, tokens) -> float:
    ids = torch.tensor(prompts, device=ref.device)
    with torch.no_grad():
        out = ref(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        sync(ref)
        start = time.perf_counter()
        for _ in range(tokens):
            out = ref(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        sync(ref)
    return time.perf_counter() - start


def sync(model) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument(
        "--attention-backend", default=None, help="triton or torch_native (default: by device)"
    )
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    cfg = create_model_config(EngineArgs(model=args.model, device=args.device, dtype=args.dtype))
    backend = select_attention_backend(cfg.device, args.attention_backend)
    model = load_model(cfg, backend)
    ref = None
    if not args.no_reference:
        ref = (
            AutoModelForCausalLM.from_pretrained(str(cfg.path), dtype=cfg.dtype)
            .to(cfg.device)
            .eval()
        )
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batch:
        prompts = torch.randint(100, 1000, (b, args.prompt_len), generator=gen).tolist()
        ours_decode(model, backend, prompts, 4)  # warm-up
        t_ours = ours_decode(model, backend, prompts, args.tokens)
        row = {"batch": b, "ours_tok_s": b * args.tokens / t_ours}
        if ref is not None:
            hf_decode(ref, prompts, 4)
            t_hf = hf_decode(ref, prompts, args.tokens)
            row["transformers_tok_s"] = b * args.tokens / t_hf
        rows.append(row)
    print(
        f"{cfg.architecture} on {cfg.device} ({platform.processor() or platform.machine()}), "
        f"{cfg.dtype}, {backend.name} attention, threads={torch.get_num_threads()}, "
        f"prompt {args.prompt_len}, {args.tokens} new tokens"
    )
    print(f"{'batch':>6} {'asyncllm tok/s':>15} {'transformers tok/s':>19}")
    for r in rows:
        print(
            f"{r['batch']:>6} {r['ours_tok_s']:>15.1f} {r.get('transformers_tok_s', float('nan')):>19.1f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "model_decode",
                "device": str(cfg.device),
                "dtype": str(cfg.dtype),
                "attention": backend.name,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
