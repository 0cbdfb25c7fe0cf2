"""The `asyncllm` command: flags from EngineArgs, `generate`, `chat` in a terminal, the
errors and exit statuses, --help and --version (signals: test_cli_signals.py)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncllm.cli.args import field_docs
from asyncllm.cli.main import BENCHMARKS, _engine_args, build_parser, main
from asyncllm.config import EngineArgs
from tests.entrypoints.procs import children

pexpect = pytest.importorskip("pexpect")  # (the test extra; the GPU machine lacks it)

ENGINE = [
    "--device", "cpu",
    "--max-model-len", "256",
    "--distributed-executor-backend", "asyncllm.executor.instant:InstantExecutor",
]  # fmt: skip


def _spawn_chat(*flags: str):
    return pexpect.spawn(
        sys.executable,
        ["-m", "asyncllm.cli.main", "chat", "--quiet", *ENGINE, *flags],
        encoding="utf-8",
        timeout=120,
    )


def _leave(child) -> int:
    """/exit, then the chat's exit status."""
    if child.isalive():
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def test_every_engine_arg_is_a_documented_flag():
    import dataclasses

    docs = field_docs(EngineArgs)
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert set(docs) == set(names), set(names) - set(docs)
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for name in names:
        assert "--" + name.replace("_", "-") in help_text
    ns = build_parser().parse_args(
        ["serve", "--max-model-len", "64", "--no-enable-prefix-caching",
         "--cudagraph-capture-sizes", "1", "2", "--dtype", "float32"]
    )  # fmt: skip
    from asyncllm.cli.main import _engine_args

    args = _engine_args(ns)
    assert args.max_model_len == 64 and args.enable_prefix_caching is False
    assert args.cudagraph_capture_sizes == [1, 2] and args.dtype == "float32"
    assert args.block_size == EngineArgs().block_size  # not given: the default


def test_generate_json_lines():
    out = subprocess.run(
        [sys.executable, "-m", "asyncllm.cli.main", "generate", "Hello", "Two words",
         "--json", "--quiet", "--max-tokens", "5", *ENGINE],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello", "Two words"]
    assert all(x["tokens"] == 5 and x["finish_reason"] == "length" and x["text"] for x in lines)
    assert "starting" not in out.stderr  # --quiet


def test_bad_flag_value_is_a_clear_error(capsys):
    # (in this process: the value is refused before any engine starts)
    assert main(["generate", "x", "--block-size", "3", *ENGINE]) == 2
    assert "block_size" in capsys.readouterr().err
    for flag, value in (
        ("--grace-period", "inf"),
        ("--grace-period", "-1"),
        ("--log-level", "debugg"),
    ):
        assert main(["serve", flag, value, *ENGINE]) == 2  # (before any engine starts)
        assert flag[2:].replace("-", "_") in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a pseudo-terminal needs POSIX")
def test_chat_in_a_terminal():
    """Two turns, /reset (the first answer again), /exit; no engine process is left
    behind."""
    child = _spawn_chat("--max-tokens", "4")
    try:
        child.expect_exact("you> ")
        engine = children(child.pid)  # the engine core and the tokenizer process
        assert len(children(child.pid, "asyncllm.engine.core_main")) == 1
        assert len(children(child.pid, "asyncllm.engine.tokenizer_process")) == 1
        assert len(engine) == 2
        child.sendline("Hello")
        child.expect(r"assistant> (.+)\r\n")
        first = child.match.group(1)
        child.expect_exact("you> ")
        child.sendline("And again")
        child.expect(r"assistant> (.+)\r\n")
        child.expect_exact("you> ")
        child.sendline("/reset")
        child.expect_exact("(history cleared)")
        child.expect_exact("you> ")
        child.sendline("Hello")  # the history is gone: the first answer again
        child.expect(r"assistant> (.+)\r\n")
        assert child.match.group(1) == first
        child.expect_exact("you> ")
    finally:
        status = _leave(child)
    assert status == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in engine)


def test_every_sampling_param_has_a_docstring():
    import dataclasses

    from asyncllm import SamplingParams

    docs = field_docs(SamplingParams)
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(docs) == names, names - set(docs)
    assert all(len(doc.split()) >= 4 for doc in docs.values())


def test_generate_labels_several_prompts_and_reads_dash_from_stdin():
    """Several prompts: each answer under a `[i] prompt` header; `-` stands for stdin's
    non-empty lines, in its place."""
    out = subprocess.run(
        [sys.executable, "-m", "asyncllm.cli.main", "generate", "First", "-",
         "--quiet", "--max-tokens", "3", *ENGINE],
        input="Hello\n\n  \nTwo  words\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    header = re.compile(r"^\[\d+\] .*$", re.M)
    assert header.findall(out.stdout) == ["[1] First", "[2] Hello", "[3] Two words"]
    before, *answers = header.split(out.stdout)
    assert before == "" and all(a.strip() for a in answers)  # (3 tokens under each)


def test_a_failed_engine_start_is_one_line(capfd, monkeypatch):
    """A model that does not exist: exit status 1 and one line naming the cause (from
    every process); --debug adds the traceback before it."""
    monkeypatch.setenv("ASYNCLLM_PROGRESS", "1")  # (--quiet sets it in this process)
    argv = ["generate", "x", "--quiet", "--model", "/nonexistent", *ENGINE]
    assert main(argv) == 1
    first = capfd.readouterr().err
    assert first.startswith("asyncllm: error: the engine failed to start: FileNotFoundError: ")
    assert "/nonexistent" in first and first.count("\n") == 1
    assert main([*argv, "--debug"]) == 1
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.endswith("\n" + first)  # (the same line, last)


def test_bad_arguments_exit_2(capsys):
    for argv in (
        ["generate"],
        ["generate", "x", "--max-tokens", "many"],
        ["generate", "x", "--no-such-flag"],
        ["bench", "no_such_benchmark"],
        ["frobnicate"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "error:" in capsys.readouterr().err
    assert main(["generate", "-", "-"]) == 2
    assert "`-`" in capsys.readouterr().err
    assert main(["serve", "org/a", "--model", "org/b"]) == 2  # (before any engine starts)
    err = capsys.readouterr().err
    assert "asyncllm: error: two models given: 'org/a' and --model 'org/b'" in err


def test_version_and_every_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"asyncllm {importlib.metadata.version('asyncllm')}\n"
    for argv in ([], ["generate"], ["chat"], ["serve"], ["bench"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
        assert capsys.readouterr().out.startswith(f"usage: {' '.join(['asyncllm', *argv])}")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listing = capsys.readouterr().out
    assert all(name in listing for name in BENCHMARKS)
    for name in BENCHMARKS:  # each benchmark's own flags
        with pytest.raises(SystemExit) as e:
            main(["bench", name, "--help"])
        assert e.value.code == 0, name
        assert "--max-model-len" in capsys.readouterr().out


def test_parse_serve_model_and_debug():
    """`serve MODEL` as vLLM takes it (the same as --model); --debug before or after
    the command."""
    parse = build_parser().parse_known_args
    assert _engine_args(parse(["serve", "org/m", "--port", "9"])[0]).model == "org/m"
    assert _engine_args(parse(["serve", "org/m", "--model", "org/m"])[0]).model == "org/m"
    assert _engine_args(parse(["serve", "--model", "org/m"])[0]).model == "org/m"
    assert _engine_args(parse(["serve"])[0]).model is None
    assert parse(["--debug", "serve"])[0].debug and parse(["serve", "--debug"])[0].debug
    assert not parse(["serve"])[0].debug
