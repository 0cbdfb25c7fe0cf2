"""A Discord bot that answers when mentioned (or in a DM), streaming by editing its reply.

One AsyncLLM serves every conversation at once; each answer is one request. The
handler (`answer`) needs only the message's `content`, `author`, `mentions` and
`reply()`, so it runs without Discord in tests.

    pip install discord.py
    DISCORD_TOKEN=... python examples/discord_bot.py
    pytest tests/examples/test_bots.py    # or try it offline: fake messages, no token
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams

LIMIT = 2000  # Discord's message length
EDIT_EVERY_S = 1.0  # edits are rate-limited: at most one a second while streaming
PARAMS = SamplingParams(max_tokens=256, temperature=0.7, output_kind=RequestOutputKind.DELTA)


def question_of(message: Any, me: Any) -> str | None:
    """The text the bot should answer, or None (its own message, or not for it)."""
    if message.author == me or getattr(message.author, "bot", False):
        return None
    is_dm = getattr(message, "guild", None) is None
    if not is_dm and me not in message.mentions:
        return None
    text = re.sub(r"<@!?\d+>", "", message.content).strip()
    return text or None


async def answer(
    llm: AsyncLLM, message: Any, me: Any, params: SamplingParams = PARAMS
) -> str | None:
    """Streams the answer to `message` into one reply, edited as tokens come."""
    question = question_of(message, me)
    if question is None:
        return None
    reply = await message.reply("…")
    text, last_edit = "", time.monotonic()
    async for out in llm.chat([{"role": "user", "content": question}], params):
        text += out.outputs[0].text
        if time.monotonic() - last_edit >= EDIT_EVERY_S and text.strip():
            await reply.edit(content=text[:LIMIT])
            last_edit = time.monotonic()
    final = text.strip()[:LIMIT] or "(no answer)"
    await reply.edit(content=final)
    return final


def main() -> None:
    if not os.environ.get("DISCORD_TOKEN"):
        print(
            "discord_bot.py: DISCORD_TOKEN is not set (your bot's token); to try the bot "
            "offline, with fake messages: pytest tests/examples/test_bots.py",
            file=sys.stderr,
        )
        sys.exit(2)
    import discord

    llm = AsyncLLM()

    class Bot(discord.Client):
        async def setup_hook(self) -> None:  # in discord's loop, before it connects
            await llm.start()

        async def on_message(self, message: discord.Message) -> None:
            await answer(llm, message, self.user)

        async def close(self) -> None:
            await llm.shutdown()
            await super().close()

    intents = discord.Intents.default()
    intents.message_content = True
    Bot(intents=intents).run(os.environ["DISCORD_TOKEN"])


if __name__ == "__main__":
    main()
