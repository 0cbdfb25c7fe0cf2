"""Answers a few chat questions at once with the embedded SmolLM2-135M-Instruct, through `LLM`.

make demo            # or: python examples/demo.py "your question" "another one"
"""

from __future__ import annotations

import sys
import time

from asyncllm import LLM, SamplingParams

QUESTIONS = [
    "What are three good reasons to learn Python? Answer briefly.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about the sea.",
]


def main() -> None:
    questions = sys.argv[1:] or QUESTIONS
    start = time.perf_counter()
    llm = LLM()  # no model named: the embedded default
    print(f"[ready in {time.perf_counter() - start:.1f} s]\n")
    params = SamplingParams(temperature=0.0, max_tokens=160)
    start = time.perf_counter()
    outputs = llm.chat(
        [[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    tokens = 0
    for q, out in zip(questions, outputs):
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        print(f"> {q}\n{completion.text.strip()}\n[{completion.finish_reason}]\n")
    stats = llm.get_stats()
    print(
        f"[{len(questions)} answers, {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s) "
        f"in {stats['num_steps']} engine steps; {stats['num_free_blocks']} of {stats['num_blocks']} KV blocks free]"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
