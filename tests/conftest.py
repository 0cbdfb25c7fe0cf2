"""Suite-wide settings: offline hub, a shared model cache, bounded threads, no stray children."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
# Converted models are shared by all runs of the suite on this checkout.
os.environ.setdefault("ASYNCLLM_CACHE", str(ROOT / ".cache" / "asyncllm-test"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The ppid is the second field after the parenthesised command name.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


@pytest.fixture(scope="session", autouse=True)
def no_child_outlives_the_suite():
    yield
    if not Path("/proc").is_dir():
        return
    import time

    deadline = time.monotonic() + 10
    while (left := _children(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"child processes outlived the suite: {left}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
