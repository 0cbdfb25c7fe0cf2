"""The Discord and Slack examples' handlers with fake messages and a model-free engine
(the real libraries are not needed: the handlers touch only what the fakes provide)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from asyncllm import AsyncLLM, SamplingParams

INSTANT = dict(
    device="cpu",
    max_model_len=512,
    distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@dataclass
class FakeUser:
    name: str
    bot: bool = False


@dataclass
class FakeReply:
    edits: list[str] = field(default_factory=list)

    async def edit(self, content: str) -> None:
        self.edits.append(content)


@dataclass
class FakeMessage:
    content: str
    author: FakeUser
    mentions: list[FakeUser]
    guild: Any = "a server"
    replies: list[FakeReply] = field(default_factory=list)

    async def reply(self, text: str) -> FakeReply:
        r = FakeReply([text])
        self.replies.append(r)
        return r


async def test_discord_handler_answers_mentions_only():
    bot = _load("discord_bot")
    me, user = FakeUser("asyncllm", bot=True), FakeUser("ann")
    params = SamplingParams(max_tokens=6, output_kind=bot.PARAMS.output_kind)
    async with AsyncLLM(**INSTANT) as llm:
        mentioned = FakeMessage("<@123> What is a KV cache?", user, [me])
        final = await bot.answer(llm, mentioned, me, params)
        (reply,) = mentioned.replies
        assert final and reply.edits[0] == "…" and reply.edits[-1] == final
        want = [
            o async for o in llm.chat([{"role": "user", "content": "What is a KV cache?"}], params)
        ]
        assert final == "".join(o.outputs[0].text for o in want).strip()
        dm = FakeMessage("hello", user, [], guild=None)
        assert await bot.answer(llm, dm, me, params)
        for ignored in (
            FakeMessage("no mention here", user, []),
            FakeMessage("<@123> me again", me, [me]),  # its own message
            FakeMessage("<@123>", user, [me]),  # nothing to answer
        ):
            assert await bot.answer(llm, ignored, me, params) is None and not ignored.replies


async def test_slack_handler_answers_in_the_thread():
    bot = _load("slack_bot")
    said: list[dict[str, Any]] = []

    async def say(**kwargs: Any) -> None:
        said.append(kwargs)

    params = SamplingParams(max_tokens=6)
    async with AsyncLLM(**INSTANT) as llm:
        answer = await bot.on_mention(llm, {"text": "<@U1ABC> hi there", "ts": "17.1"}, say, params)
        assert said == [{"text": answer, "thread_ts": "17.1"}] and answer
        await bot.on_mention(llm, {"text": "again", "ts": "18.2", "thread_ts": "17.1"}, say, params)
        assert said[-1]["thread_ts"] == "17.1"
        assert await bot.on_mention(llm, {"text": "<@U1ABC>", "ts": "19.0"}, say, params) is None
        assert len(said) == 2


@pytest.mark.parametrize(
    "bot, unset, present",
    [
        ("discord_bot", ["DISCORD_TOKEN"], []),
        ("slack_bot", ["SLACK_BOT_TOKEN", "SLACK_APP_TOKEN"], []),
        ("slack_bot", ["SLACK_BOT_TOKEN"], ["SLACK_APP_TOKEN"]),
    ],
    ids=["discord", "slack-no-tokens", "slack-no-bot-token"],
)
def test_a_bot_without_its_token_says_so_in_one_line(bot, unset, present):
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update({name: "a-token" for name in present})
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{bot}.py")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == "", out
    (line,) = out.stderr.splitlines()  # one line, no traceback
    assert line.startswith(f"{bot}.py: ") and "Traceback" not in out.stderr
    assert all(name in line for name in unset) and not any(name in line for name in present)
    # it points at the offline way to try the bot: this file, under pytest
    assert line.endswith(" pytest tests/examples/test_bots.py")
    assert (EXAMPLES.parent / "tests/examples/test_bots.py").resolve() == Path(__file__).resolve()
