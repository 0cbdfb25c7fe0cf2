"""The `asyncllm` command: generate, chat, serve, bench.

Every command runs the embedded default model when no --model is given and takes the
EngineArgs fields as flags (`asyncllm serve --help` lists them with their meaning).
Errors are one line on stderr (with --debug, the traceback before it); the exit status
is 2 for bad arguments, 1 for any other failure (an engine that failed to start), 130
after Ctrl-C and 128 + the signal's number after SIGTERM or SIGHUP (docs/cli.md).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.util
import json
import signal
import sys
import traceback
from collections.abc import Awaitable, Sequence
from typing import IO, Any

from asyncllm import envs
from asyncllm.cli.args import add_dataclass_flags, dataclass_kwargs
from asyncllm.config import EngineArgs
from asyncllm.errors import EngineStartupError

BENCHMARKS = ("latency", "throughput", "serving", "startup", "step_profile", "roofline", "spec")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


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


def _params(ns: argparse.Namespace) -> Any:
    from asyncllm import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.sampling_seed
    )


def _server_flags(p: argparse.ArgumentParser) -> None:
    from asyncllm.entrypoints.openai.server import ServerArgs

    add_dataclass_flags(p.add_argument_group("server"), ServerArgs)


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    kwargs = dataclass_kwargs(ns, EngineArgs)
    tag = getattr(ns, "model_tag", None)  # (serve's positional MODEL)
    if tag is not None:
        if kwargs.get("model", tag) != tag:
            raise ValueError(f"two models given: {tag!r} and --model {kwargs['model']!r}")
        kwargs["model"] = tag
    return EngineArgs(**kwargs)


def _debug_flag(p: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    # (a subcommand's default is SUPPRESS, so it never undoes `asyncllm --debug CMD`)
    p.add_argument("--debug", action="store_true", default=default, help="tracebacks on errors")


class _Version(argparse.Action):
    """--version: the installed package's version, looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        import importlib.metadata

        try:
            version = importlib.metadata.version("asyncllm")
        except importlib.metadata.PackageNotFoundError:  # (a source tree, not installed)
            version = "(not installed)"
        print(f"asyncllm {version}")
        parser.exit()


def _summary(module: str) -> str:
    """The first paragraph of a module's docstring, read without importing it (a
    benchmark imports torch)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_Version, help="the version, then exit")
    _debug_flag(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="complete prompts, streamed to stdout")
    p.add_argument(
        "prompts",
        nargs="+",
        metavar="PROMPT",
        help="a prompt; `-` reads the prompts from stdin, one per non-empty line",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _debug_flag(p)
    _sampling_flags(p)
    _engine_flags(p)

    p = sub.add_parser("chat", help="an interactive chat in the terminal")
    p.add_argument("--system", default=None, help="a system message to start with")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _debug_flag(p)
    _sampling_flags(p)
    _engine_flags(p)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve (as --model)")
    _server_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _debug_flag(p)
    _engine_flags(p)

    p = sub.add_parser("bench", help="the package's benchmarks")
    _debug_flag(p)
    benchmarks = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        summary = _summary(f"asyncllm.bench.{name}")
        # Its flags are the benchmark's own: main() hands them over (`--help` included).
        benchmarks.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if rest and ns.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(ns, "quiet", False):
        envs.hide_progress()
    try:
        return _run(ns, rest)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError) as e:
        return _error(ns, str(e), 2)
    except EngineStartupError as e:
        reason = str(e).removeprefix("engine core failed to start: ")
        return _error(ns, f"the engine failed to start: {reason}", 1)
    except Exception as e:  # noqa: BLE001 (one line, unless --debug)
        return _error(ns, f"{type(e).__name__}: {e}", 1)


def _error(ns: argparse.Namespace, message: str, code: int) -> int:
    if ns.debug:
        traceback.print_exc()
    print(f"asyncllm: error: {message}", file=sys.stderr)
    return code


def _run(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.command == "bench":
        import importlib

        importlib.import_module(f"asyncllm.bench.{ns.benchmark}").main(rest)
        return 0
    if ns.command == "serve":  # (the server handles SIGINT and SIGTERM itself)
        from asyncllm.entrypoints.openai.server import ServerArgs, serve

        server_args = ServerArgs(**dataclass_kwargs(ns, ServerArgs))
        asyncio.run(serve(_engine_args(ns), server_args))
        return 0
    if ns.command == "generate":
        prompts = read_prompts(ns.prompts, sys.stdin)
        work = run_generate(_engine_args(ns), _params(ns), prompts, ns.json, ns.quiet)
    else:
        from asyncllm.cli.chat import run_chat

        work = run_chat(_engine_args(ns), _params(ns), ns.system, ns.quiet)
    return asyncio.run(_until_stopped(work))


async def _until_stopped(work: Awaitable[None]) -> int:
    """Awaits `work`; SIGTERM or SIGHUP cancel it, so the engine shuts down in order (no
    child process, no socket folder left). The exit status: 0, or 128 + the signal's
    number. A second such signal meets the default action: this process ends at once,
    and its children follow (their stdin reaches EOF)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopped_by: list[int] = []

    def stop(sig: int) -> None:
        stopped_by.append(sig)
        for s in STOP_SIGNALS:
            loop.remove_signal_handler(s)
        task.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        await work
    except asyncio.CancelledError:
        if not stopped_by:
            raise  # (Ctrl-C: asyncio.run raises KeyboardInterrupt)
        return 128 + stopped_by[0]
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    return 0


# -- generate --------------------------------------------------------------------------


def read_prompts(args: list[str], stdin: IO[str]) -> list[str]:
    """The prompts as given, `-` replaced by stdin's non-empty lines (read once, before
    the engine starts)."""
    if args.count("-") > 1:
        raise ValueError("`-` (the prompts from stdin) may be given once")
    prompts: list[str] = []
    for arg in args:
        if arg == "-":
            prompts += [line for line in stdin.read().splitlines() if line.strip()]
        else:
            prompts.append(arg)
    if not prompts:
        raise ValueError("no prompt: stdin had no non-empty line")
    return prompts


async def run_generate(
    args: EngineArgs, params: Any, prompts: list[str], as_json: bool, quiet: bool
) -> None:
    from asyncllm import AsyncLLM, RequestOutputKind

    params = params.clone(output_kind=RequestOutputKind.DELTA)
    if not quiet:
        print("asyncllm: starting the engine ...", file=sys.stderr, flush=True)
    async with AsyncLLM.from_engine_args(args) as llm:
        if as_json:
            outs = await asyncio.gather(*[_collect(llm, p, params) for p in prompts])
            for prompt, (text, reason, n) in zip(prompts, outs, strict=True):
                line = {"prompt": prompt, "text": text, "finish_reason": reason, "tokens": n}
                print(json.dumps(line, ensure_ascii=False), flush=True)
            return
        for i, prompt in enumerate(prompts, 1):  # one after another, each streamed
            if len(prompts) > 1:  # a header: the prompt's number and its text, on one line
                sep = "\n" if i > 1 else ""
                sys.stdout.write(f"{sep}[{i}] {' '.join(prompt.split())}\n")
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
