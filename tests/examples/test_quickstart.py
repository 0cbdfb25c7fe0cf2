"""examples/quickstart.py (what `make demo` runs) with the embedded model, short answers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_streams_answers_then_a_throughput_line():
    out = subprocess.run(
        [sys.executable, str(QUICKSTART), "--max-tokens", "6", "Say hi.", "Name a colour."],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "> Say hi." in out.stdout and "> Name a colour." in out.stdout
    m = re.search(r"\[throughput: (\d+) output tokens in [\d.]+ s, [\d.]+ tok/s\]", out.stdout)
    assert m and 2 <= int(m.group(1)) <= 12  # two answers of at most 6 tokens each
    assert re.search(r"(\d+) of \1 KV blocks free", out.stdout)


def test_quickstart_refuses_a_bad_max_tokens_in_one_line():
    for bad in ("0", "-3", "x"):
        out = subprocess.run(
            [sys.executable, str(QUICKSTART), "--max-tokens", bad, "Say hi."],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2 and out.stdout == "", out
        *usage, line = out.stderr.splitlines()  # argparse's usage line, then the error
        assert line.startswith("quickstart.py: error: ") and "--max-tokens" in line, out
        assert len(usage) == 1 and "Traceback" not in out.stderr, out
