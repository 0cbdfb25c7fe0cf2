"""The `asyncllm` command: flags from EngineArgs, `generate`, and `chat` in a terminal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncllm.cli.args import field_docs
from asyncllm.cli.main import build_parser, main
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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a pseudo-terminal needs POSIX")
def test_chat_ctrl_c_stops_only_the_answer():
    """Ctrl-C during a long answer: "(interrupted)", and the chat goes on to /exit."""
    child = _spawn_chat("--max-tokens", "8000", "--max-model-len", "8192")
    try:
        child.expect_exact("you> ")
        child.sendline("Talk")
        child.expect_exact("assistant> ")
        child.expect(r"\S")  # it is answering
        child.kill(signal.SIGINT)
        child.expect_exact("(interrupted)")
        child.expect_exact("you> ")
    finally:
        status = _leave(child)
    assert status == 0


def test_every_sampling_param_has_a_docstring():
    import dataclasses

    from asyncllm import SamplingParams

    docs = field_docs(SamplingParams)
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(docs) == names, names - set(docs)
    assert all(len(doc.split()) >= 4 for doc in docs.values())
