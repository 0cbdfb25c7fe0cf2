"""examples/agent_loop.py on the embedded SmolLM2, offline, with a fixed clock: the model
routes each question to its tool, the call validates against the tool's schema, the
loop's result is what the tool computes, and the model answers after it."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from tests.examples.test_bots import _load

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
agent_loop = _load("agent_loop")
NOW = datetime(2026, 12, 3, 8, 30, tzinfo=UTC)


def _schema(name: str) -> dict:
    (fn,) = [t["function"] for t in agent_loop.TOOLS if t["function"]["name"] == name]
    return fn["parameters"]


def test_the_calculator_evaluates_arithmetic_only():
    assert agent_loop.calculate("3 + 4 * (5 - 1) / 2") == 11
    for bad in ("__import__('os')", "2 ** 8", "x + 1", "(1", "2 +", ""):
        with pytest.raises(ValueError, match="not arithmetic"):
            agent_loop.calculate(bad)
    agent = agent_loop.Agent(llm=None, now=lambda: NOW)
    assert agent.run_tool("calculator", '{"expression": "1 / 0"}').startswith("error:")
    # what the tool's schema lets through but is not arithmetic is an error for the model
    assert agent.run_tool("calculator", '{"expression": "(1"}') == "error: not arithmetic: '(1'"
    assert agent.run_tool("calculator", '{"expression": 5}').startswith("error:")
    assert agent.run_tool("clock", '{"city": "Paris"}') == "2026-12-03 09:30 CET"
    assert agent.run_tool("weather", "{}") == "error: no tool named 'weather'"


@pytest.mark.asyncio(loop_scope="session")
async def test_the_agent_calls_the_calculator_and_the_clock(allm):
    agent = agent_loop.Agent(allm, now=lambda: NOW)
    asked = {"What is 12 times 7?": "calculator", "What time is it in Tokyo?": "clock"}
    for question, tool in asked.items():
        answer, messages = await agent.ask(question)
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        (call,) = messages[2]["tool_calls"]
        assert call["function"]["name"] == tool, messages
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, _schema(tool))
        result = messages[3]["content"]
        if tool == "calculator":
            assert float(result) == agent_loop.calculate(args["expression"])
        else:
            zone = ZoneInfo(agent_loop.CITIES[args["city"]])
            assert result == NOW.astimezone(zone).strftime("%Y-%m-%d %H:%M %Z")
        assert answer and messages[4]["content"].strip() == answer
    # every block comes back (an answer ended by its stop string is aborted in the core
    # after the client has its output: wait for that condition)
    for _ in range(600):
        stats = await allm.get_stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        await asyncio.sleep(0.05)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_waiting"] == 0
