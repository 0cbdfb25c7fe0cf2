"""Streams answers to several chat questions at once from the embedded SmolLM2-135M-Instruct,
through AsyncLLM (an engine-core process batching all of them together).

    make demo            # or: python examples/demo.py "your question" "another one"
"""

from __future__ import annotations

import asyncio
import sys
import time

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams

QUESTIONS = [
    "What are three good reasons to learn Python? Answer briefly.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about the sea.",
]


async def main() -> None:
    questions = sys.argv[1:] or QUESTIONS
    start = time.perf_counter()
    async with AsyncLLM() as llm:  # no model named: the embedded default
        print(f"[engine ready in {time.perf_counter() - start:.1f} s]\n")
        params = SamplingParams(
            temperature=0.0, max_tokens=160, output_kind=RequestOutputKind.DELTA
        )

        async def answer(question: str, live: bool) -> str:
            text = ""
            async for out in llm.chat([{"role": "user", "content": question}], params):
                text += out.outputs[0].delta
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


if __name__ == "__main__":
    asyncio.run(main())
