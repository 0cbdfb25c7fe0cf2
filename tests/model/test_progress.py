"""The progress bars of model conversion and loading: on a terminal only, off with
ASYNCLLM_PROGRESS=0 (what `--quiet` sets)."""

from __future__ import annotations

import io

from asyncllm.model.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drawn(monkeypatch, stream: io.StringIO) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    assert list(progress(range(5), "loading model.safetensors")) == [0, 1, 2, 3, 4]
    return stream.getvalue()


def test_a_bar_on_a_terminal(monkeypatch):
    monkeypatch.delenv("ASYNCLLM_PROGRESS", raising=False)
    out = _drawn(monkeypatch, Terminal())
    assert "loading model.safetensors" in out and "0/5" in out  # (then cleared: leave=False)


def test_no_bar_when_quiet_or_not_a_terminal(monkeypatch):
    monkeypatch.setenv("ASYNCLLM_PROGRESS", "0")
    assert _drawn(monkeypatch, Terminal()) == ""
    monkeypatch.delenv("ASYNCLLM_PROGRESS")
    assert _drawn(monkeypatch, io.StringIO()) == ""
