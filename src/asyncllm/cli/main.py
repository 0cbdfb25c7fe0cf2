"""The `asyncllm` command: generate, chat, serve, bench.

Every command runs the embedded default model when no --model is given and takes the
EngineArgs fields as flags (`asyncllm serve --help` lists them with their meaning).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from asyncllm import envs
from asyncllm.cli.args import add_dataclass_flags, dataclass_kwargs
from asyncllm.config import EngineArgs

BENCHMARKS = ("latency", "throughput", "serving", "startup", "step_profile")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    add_dataclass_flags(p.add_argument_group("engine (EngineArgs)"), EngineArgs)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=256, help="tokens per answer at most (default: 256)"
    )
    g.add_argument("--temperature", type=float, default=0.7, help="(default: 0.7)")
    g.add_argument("--top-p", type=float, default=0.95, help="(default: 0.95)")
    g.add_argument(
        "--sampling-seed", type=int, default=None, help="each request's seed (default: none)"
    )


def _params(ns: argparse.Namespace, **kw: Any) -> Any:
    from asyncllm import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        seed=ns.sampling_seed,
        **kw,
    )


def _server_flags(p: argparse.ArgumentParser) -> None:
    from asyncllm.entrypoints.openai.server import ServerArgs

    add_dataclass_flags(p.add_argument_group("server"), ServerArgs)


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**dataclass_kwargs(ns, EngineArgs))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete prompts, streamed to stdout")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _sampling_flags(p)
    _engine_flags(p)

    p = sub.add_parser("chat", help="an interactive chat in the terminal")
    p.add_argument("--system", default=None, help="a system message to start with")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _sampling_flags(p)
    _engine_flags(p)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _server_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _engine_flags(p)

    p = sub.add_parser("bench", help="the package's benchmarks", add_help=False)
    p.add_argument("benchmark", choices=BENCHMARKS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if getattr(ns, "quiet", False):
        envs.hide_progress()
    try:
        if ns.command == "bench":
            import importlib

            importlib.import_module(f"asyncllm.bench.{ns.benchmark}").main(ns.rest)
        elif ns.command == "serve":
            from asyncllm.entrypoints.openai.server import ServerArgs, serve

            server_args = ServerArgs(**dataclass_kwargs(ns, ServerArgs))
            asyncio.run(serve(_engine_args(ns), server_args))
        elif ns.command == "generate":
            asyncio.run(_generate(ns))
        else:
            from asyncllm.cli.chat import run_chat

            asyncio.run(run_chat(_engine_args(ns), _params(ns), ns.system, ns.quiet))
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError) as e:
        print(f"asyncllm: {e}", file=sys.stderr)
        return 2
    return 0


async def _generate(ns: argparse.Namespace) -> None:
    from asyncllm import AsyncLLM, RequestOutputKind

    args = _engine_args(ns)
    params = _params(ns, output_kind=RequestOutputKind.DELTA)
    if not ns.quiet:
        print("asyncllm: starting the engine ...", file=sys.stderr, flush=True)
    async with AsyncLLM.from_engine_args(args) as llm:
        if ns.json:
            outs = await asyncio.gather(*[_collect(llm, p, params) for p in ns.prompts])
            for prompt, (text, reason, n) in zip(ns.prompts, outs):
                line = {"prompt": prompt, "text": text, "finish_reason": reason, "tokens": n}
                print(json.dumps(line, ensure_ascii=False), flush=True)
            return
        for prompt in ns.prompts:  # one after another, each streamed
            async for out in llm.generate(prompt, params):
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
            sys.stdout.write("\n")


async def _collect(llm: Any, prompt: str, params: Any) -> tuple[str, str | None, int]:
    text, reason, n = "", None, 0
    async for out in llm.generate(prompt, params):
        c = out.outputs[0]
        text += c.text
        n += len(c.token_ids)
        reason = c.finish_reason
    return text, reason, n


if __name__ == "__main__":
    sys.exit(main())
