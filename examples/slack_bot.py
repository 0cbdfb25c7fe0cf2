"""A Slack bot (slack_bolt's async app, Socket Mode) that answers mentions in a thread.

One AsyncLLM serves every conversation; the handler (`on_mention`) needs only the event
dict and `say`, so it runs without Slack in tests.

    pip install slack_bolt aiohttp
    SLACK_BOT_TOKEN=xoxb-... SLACK_APP_TOKEN=xapp-... python examples/slack_bot.py
    pytest tests/examples/test_bots.py    # or try it offline: fake events, no tokens
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from asyncllm import AsyncLLM, SamplingParams

PARAMS = SamplingParams(max_tokens=256, temperature=0.7)


async def on_mention(
    llm: AsyncLLM,
    event: dict[str, Any],
    say: Callable[..., Awaitable[Any]],
    params: SamplingParams = PARAMS,
) -> str | None:
    """Answers an `app_mention` event in its thread; None if there is nothing to answer."""
    question = re.sub(r"<@[A-Z0-9]+>", "", event.get("text", "")).strip()
    if not question:
        return None
    text = ""
    async for out in llm.chat([{"role": "user", "content": question}], params):
        text = out.outputs[0].text  # (cumulative: the whole answer so far)
    answer = text.strip() or "(no answer)"
    await say(text=answer, thread_ts=event.get("thread_ts") or event["ts"])
    return answer


async def main() -> None:
    missing = [v for v in ("SLACK_BOT_TOKEN", "SLACK_APP_TOKEN") if not os.environ.get(v)]
    if missing:
        print(
            f"slack_bot.py: {' and '.join(missing)} not set (your app's tokens); to try the "
            "bot offline, with fake events: pytest tests/examples/test_bots.py",
            file=sys.stderr,
        )
        sys.exit(2)
    from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
    from slack_bolt.async_app import AsyncApp

    app = AsyncApp(token=os.environ["SLACK_BOT_TOKEN"])
    async with AsyncLLM() as llm:

        @app.event("app_mention")
        async def handle(event: dict[str, Any], say: Callable[..., Awaitable[Any]]) -> None:
            await on_mention(llm, event, say)

        await AsyncSocketModeHandler(app, os.environ["SLACK_APP_TOKEN"]).start_async()


if __name__ == "__main__":
    asyncio.run(main())
