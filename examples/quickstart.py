"""Streams answers to several chat questions at once from the embedded SmolLM2-135M-Instruct,
through AsyncLLM (an engine-core process batching all of them together), then prints
the throughput.

    make demo            # or: python examples/quickstart.py [--max-tokens N] "a question" ...
"""

from __future__ import annotations

import argparse
import asyncio
import time

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams

QUESTIONS = [
    "What are three good reasons to learn Python? Answer briefly.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about the sea.",
]


async def main() -> None:
    ap = argparse.ArgumentParser(description="Several chat answers streamed at once.")
    ap.add_argument("questions", nargs="*", help="(default: three built-in questions)")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    questions = args.questions or QUESTIONS
    start = time.perf_counter()
    async with AsyncLLM() as llm:  # no model named: the embedded default
        print(f"[engine ready in {time.perf_counter() - start:.1f} s]\n")
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, output_kind=RequestOutputKind.DELTA
        )

        tokens = 0

        async def answer(question: str, live: bool) -> str:
            nonlocal tokens
            text = ""
            async for out in llm.chat([{"role": "user", "content": question}], params):
                text += out.outputs[0].delta
                tokens += len(out.outputs[0].token_ids)
                if live:
                    print(out.outputs[0].delta, end="", flush=True)
            return text

        start = time.perf_counter()
        # The first answer streams to the terminal; the others run in the same batches.
        print(f"> {questions[0]}")
        tasks = [asyncio.create_task(answer(q, live=(i == 0))) for i, q in enumerate(questions)]
        await tasks[0]
        print("\n")
        for q, task in zip(questions[1:], tasks[1:]):
            print(f"> {q}\n{(await task).strip()}\n")
        elapsed = time.perf_counter() - start
        stats = await llm.get_stats()
        print(
            f"[{len(questions)} answers in {elapsed:.1f} s, {stats['num_steps']} engine steps, "
            f"mean time to first token {stats['ttft_s']['mean']:.2f} s; "
            f"{stats['num_free_blocks']} of {stats['num_blocks']} KV blocks free]"
        )
        print(
            f"[throughput: {tokens} output tokens in {elapsed:.1f} s, {tokens / elapsed:.1f} tok/s]"
        )


if __name__ == "__main__":
    asyncio.run(main())
