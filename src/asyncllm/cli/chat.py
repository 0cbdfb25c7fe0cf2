"""`asyncllm chat`: a streaming chat in the terminal.

The history is kept across turns; `/reset` clears it, `/exit` (or end of input) leaves.
Ctrl-C during an answer stops that answer (its request is aborted in the engine) and
the chat goes on; Ctrl-C at the prompt leaves. (The engine's processes ignore a
terminal's Ctrl-C: `engine.host_launcher.start_child`.)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any

from asyncllm.config import EngineArgs

PROMPT = "you> "


def _start_reader(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[str | None]) -> None:
    """Lines of stdin into the queue (None at the end), from a daemon thread, so a
    pending read never holds up the exit."""

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.rstrip("\n"))
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, name="asyncllm-chat-stdin", daemon=True).start()


async def _answer(llm: Any, history: list[dict[str, str]], params: Any) -> str:
    text = ""
    sys.stdout.write("assistant> ")
    async for out in llm.chat(history, params):
        delta = out.outputs[0].text
        text += delta
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return text


async def run_chat(args: EngineArgs, params: Any, system: str | None, quiet: bool) -> None:
    from asyncllm import AsyncLLM, RequestOutputKind

    params = params.clone(output_kind=RequestOutputKind.DELTA)
    base = [{"role": "system", "content": system}] if system else []
    if not quiet:
        print("asyncllm: starting the engine ...", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    answering: asyncio.Task[str] | None = None

    def on_interrupt() -> None:
        if answering is not None and not answering.done():
            answering.cancel()
        else:
            lines.put_nowait(None)  # at the prompt: leave

    async with AsyncLLM.from_engine_args(args) as llm:
        loop.add_signal_handler(signal.SIGINT, on_interrupt)
        try:
            print("Type a message; /reset clears the history, /exit leaves.", flush=True)
            _start_reader(loop, lines)
            history = list(base)
            while True:
                sys.stdout.write(PROMPT)
                sys.stdout.flush()
                line = await lines.get()
                if line is None or line.strip() == "/exit":
                    sys.stdout.write("\n" if line is None else "")
                    break
                if line.strip() == "/reset":
                    history = list(base)
                    print("(history cleared)", flush=True)
                    continue
                if not line.strip():
                    continue
                history.append({"role": "user", "content": line})
                answering = asyncio.ensure_future(_answer(llm, history, params))
                try:
                    text = await answering
                except asyncio.CancelledError:
                    if task.cancelling():
                        raise  # (the chat itself is being cancelled: SIGTERM, SIGHUP)
                    print("\n(interrupted)", flush=True)
                    history.pop()  # the question had no answer
                    continue
                finally:
                    answering = None
                history.append({"role": "assistant", "content": text})
        finally:
            loop.remove_signal_handler(signal.SIGINT)
