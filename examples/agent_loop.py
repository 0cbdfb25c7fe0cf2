"""A small agent on the embedded SmolLM2-135M-Instruct: the model calls a calculator or
a clock tool, the loop runs the call and feeds the result back, and the model answers.

    python examples/agent_loop.py "What is 12 times 7?" "What time is it in Tokyo?"

A 135M model calls tools reliably here because each of its decisions is constrained:
it picks the tool by answering a one-word choice (structured outputs), makes the call
with that tool named in `tool_choice` (its arguments validate against the tool's
schema: the calculator's expression can only be arithmetic, the clock's city one of a
list), and, once the loop has run the call and fed the result back, answers with
`tool_choice="none"`. A larger model can be asked with `tool_choice="required"` (or
`"auto"`) and choose the tool itself.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from asyncllm import AsyncLLM, SamplingParams, StructuredOutputsParams

CITIES = {
    "London": "Europe/London",
    "Paris": "Europe/Paris",
    "New York": "America/New_York",
    "Tokyo": "Asia/Tokyo",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression of numbers, + - * / and ().",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "pattern": "^[0-9(][0-9+*/(). -]{0,31}$",
                        "description": "for example 12 * 7",
                    }
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "description": "The current date and time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": list(CITIES)}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
SYSTEM = "You are a helpful assistant. Use the tools for arithmetic and for the time."
TOPICS = {"math": "calculator", "time": "clock"}  # what the model answers -> the tool

_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression (numbers, + - * / and parentheses only)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:  # such as "(1" or "2 +", which the tool's pattern lets through
        raise ValueError(f"not arithmetic: {expression!r}") from None
    return value(tree.body)


@dataclass
class Agent:
    llm: AsyncLLM
    now: Callable[[], datetime] = lambda: datetime.now(UTC)
    params: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=48)
    )
    answer_params: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=48, stop=["\n"])
    )

    def run_tool(self, name: str, arguments: str) -> str:
        """The tool's result as text; a failure becomes the result (the model sees it)."""
        try:
            args = json.loads(arguments)
            if name == "calculator":
                result = calculate(args["expression"])
                return str(int(result) if float(result).is_integer() else result)
            if name == "clock":
                return (
                    self.now()
                    .astimezone(ZoneInfo(CITIES[args["city"]]))
                    .strftime("%Y-%m-%d %H:%M %Z")
                )
            return f"error: no tool named {name!r}"
        except (ValueError, KeyError, TypeError, ArithmeticError) as e:
            return f"error: {e}"

    async def ask(self, question: str) -> tuple[str, list[dict[str, Any]]]:
        """(the final answer, the whole conversation with its call and result)."""
        # 1. the model picks the tool: a choice constraint makes its answer one word
        route = SamplingParams(
            temperature=0.0, structured_outputs=StructuredOutputsParams(choice=list(TOPICS))
        )
        topic = await self._final(
            [{"role": "user", "content": f"Is this question about math or about time? {question}"}],
            route,
        )
        tool = TOPICS[topic.text]
        # 2. the model calls it: a named tool_choice makes the call valid for its schema
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ]
        named = {"type": "function", "function": {"name": tool}}
        call_out = await self._final(messages, self.params, tools=TOOLS, tool_choice=named)
        calls = call_out.tool_calls or []
        messages.append({
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        })  # fmt: skip
        # 3. the loop runs it and feeds the result back; the model answers in words
        for c in calls:
            result = self.run_tool(c.name, c.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        answer = await self._final(messages, self.answer_params, tools=TOOLS, tool_choice="none")
        messages.append({"role": "assistant", "content": answer.text})
        return answer.text.strip(), messages

    async def _final(self, messages: list[dict[str, Any]], params: SamplingParams, **tools: Any):
        final = None
        async for out in self.llm.chat(messages, params, **tools):
            final = out
        assert final is not None
        return final.outputs[0]


def show(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages[1:]:
        if m.get("tool_calls"):
            for c in m["tool_calls"]:
                lines.append(f"  call   {c['function']['name']}({c['function']['arguments']})")
        elif m["role"] == "tool":
            lines.append(f"  result {m['content']}")
        elif m["role"] == "user":
            lines.append(f"> {m['content']}")
        else:
            lines.append(f"  answer {m['content'].strip()}")
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description="A tool-calling agent loop.")
    ap.add_argument(
        "questions", nargs="*", default=["What is 12 times 7?", "What time is it in Tokyo?"]
    )
    args = ap.parse_args()
    async with AsyncLLM() as llm:  # the embedded default model
        agent = Agent(llm)
        results = await asyncio.gather(*(agent.ask(q) for q in args.questions))
        for _, messages in results:
            print(show(messages) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
