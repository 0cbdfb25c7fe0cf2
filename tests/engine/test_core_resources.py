"""What the engine core takes from its machine: torch threads, oneDNN's primitive cache,
the C heap's free memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncllm import EngineArgs
from asyncllm.engine.cpu_threads import set_cpu_threads


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_is_set_when_given_and_torch_s_count_kept_otherwise(keep_threads):
    torch.set_num_threads(2)
    assert set_cpu_threads(SimpleNamespace(cpu_threads=None)) == 2
    assert torch.get_num_threads() == 2
    assert set_cpu_threads(SimpleNamespace(cpu_threads=1)) == 1
    assert torch.get_num_threads() == 1


def test_an_in_process_engine_runs_with_cpu_threads(keep_threads, tmp_path):
    from tests.model.tiny import make_tiny_model, tiny_engine_core

    make_tiny_model("llama3", tmp_path)
    torch.set_num_threads(2)
    core = tiny_engine_core(tmp_path, cpu_threads=1)
    try:
        assert torch.get_num_threads() == 1
    finally:
        core.shutdown()


@pytest.mark.parametrize("value,error", [(0, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_cpu_threads_are_named(value, error):
    with pytest.raises(error, match="cpu_threads"):
        EngineArgs(cpu_threads=value)


def test_the_core_process_caps_onednn_s_primitive_cache_unless_told(monkeypatch):
    from asyncllm.engine.host_launcher import ONEDNN_PRIMITIVE_CACHE_CAPACITY, _child_env

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert _child_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert _child_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_trim_heap_gives_freed_memory_back_on_glibc():
    import ctypes
    import platform

    from asyncllm.bench.host import rss_mb
    from asyncllm.engine.heap import trim_heap

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    # Many small blocks (below the mmap threshold, so they live on the heap), freed but
    # the last one, which pins the heap's top: glibc keeps the rest until trimmed.
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(3000)]  # ~190 MB
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)  # resident
    for b in blocks[:-1]:
        libc.free(b)
    before = rss_mb()
    assert trim_heap()
    after = rss_mb()
    libc.free(blocks[-1])
    assert after < before - 100, (before, after)
