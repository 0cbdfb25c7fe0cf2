"""Streams a greedy answer from the embedded SmolLM2-135M-Instruct through the paged KV cache.

make demo            # or: python examples/demo.py "your question"
"""

from __future__ import annotations

import sys
import time

from transformers import AutoTokenizer

from asyncllm.config import EngineArgs
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.loader import load_model
from asyncllm.model.paged_decoder import PagedDecoder


def main() -> None:
    question = (
        " ".join(sys.argv[1:]) or "What are three good reasons to learn Python? Answer briefly."
    )
    start = time.perf_counter()
    config = EngineArgs().create_model_config()  # the embedded default model
    backend = TorchNativeBackend()
    model = load_model(config, backend)
    tokenizer = AutoTokenizer.from_pretrained(str(config.path))
    print(
        f"[{config.architecture} from {config.path} on {config.device}, {config.dtype}; "
        f"ready in {time.perf_counter() - start:.1f} s]\n"
    )
    print(f"> {question}\n")

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    decoder = PagedDecoder(model, backend, num_blocks=64)
    tokens: list[int] = []
    shown = ""
    start = time.perf_counter()
    for token in decoder.generate_greedy(
        prompt, max_tokens=200, stop_ids=(tokenizer.eos_token_id,)
    ):
        if token == tokenizer.eos_token_id:
            break
        tokens.append(token)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
            print(text[len(shown) :], end="", flush=True)
            shown = text
    elapsed = time.perf_counter() - start
    print(
        f"\n\n[{len(tokens)} tokens in {elapsed:.1f} s, {len(tokens) / elapsed:.1f} tok/s; "
        f"{decoder.num_free_blocks} of 64 KV blocks free again]"
    )


if __name__ == "__main__":
    main()
