"""What the engine core takes from its machine: torch threads, oneDNN's primitive cache,
the C heap's free memory."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from asyncllm import EngineArgs
from asyncllm.engine.cpu_threads import (
    ThreadTuner,
    busy_cpu_seconds,
    set_cpu_threads,
    threads_for,
)


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _config(cpu_threads=None, device="cpu"):
    return SimpleNamespace(
        cpu_threads=cpu_threads, model=SimpleNamespace(device=torch.device(device))
    )


def test_cpu_threads_is_set_when_given_and_torch_s_count_kept_otherwise(keep_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    tuner = set_cpu_threads(_config())
    assert torch.get_num_threads() == 2
    assert tuner is not None and tuner.most == 2  # follows the free CPU from torch's count
    assert set_cpu_threads(_config(cpu_threads=1)) is None  # a count given: fixed
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert set_cpu_threads(_config(device="meta")) is None  # not the CPU device
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_cpu_threads(_config()) is None  # the user's OMP_NUM_THREADS: fixed


def test_busy_cpu_seconds_reads_the_cpus_asked_for(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 30 900 5 0 0 0 0 0\n"
        "cpu0 100 0 10 400 5 0 0 0 0 0\n"
        "cpu1 200 0 20 500 0 1 2 3 0 0\n"
        "intr 1 2 3\n"
    )
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_cpu_seconds([1], str(stat)) == pytest.approx((200 + 20 + 1 + 2 + 3) / hz)
    assert busy_cpu_seconds([0, 1], str(stat)) == pytest.approx((110 + 226) / hz)


@pytest.mark.parametrize(
    "others,threads", [(0.0, 2), (0.4, 2), (0.6, 1), (1.0, 1), (1.6, 1), (2.0, 1)]
)
def test_threads_for_the_cores_other_processes_leave(others, threads):
    assert threads_for(2, others, most=2) == threads
    assert threads_for(8, others, most=4) == min(4, threads + 6)


class _Machine:
    """A fake clock and CPU counters: other processes' and the core's own busy time."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.set_to: list[int] = []

    def run(self, seconds, others, own):
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def tuner(self, cpus=2):
        return ThreadTuner(
            list(range(cpus)),
            most=cpus,
            read_busy=lambda: self.busy,
            read_own=lambda: self.own,
            clock=lambda: self.now,
            set_threads=self.set_to.append,
        )


def test_the_tuner_steps_down_while_another_process_is_busy_and_back_up_after():
    m = _Machine()
    tuner = m.tuner()
    for _ in range(3):  # idle machine: two threads, nothing changed
        m.run(1.0, others=0.0, own=2.0)
        tuner.tick()
    assert tuner.threads == 2 and m.set_to == []
    m.run(1.0, others=1.0, own=1.0)  # another process takes a core: one window proposes
    tuner.tick()
    assert m.set_to == []
    m.run(0.5, others=1.0, own=1.0)  # within the window: not read yet
    tuner.tick()
    assert m.set_to == []
    m.run(0.5, others=1.0, own=1.0)  # a second window agrees: one thread
    tuner.tick()
    assert tuner.threads == 1 and m.set_to == [1]
    m.run(1.0, others=0.0, own=1.0)  # the other process ends
    tuner.tick()
    m.run(1.0, others=0.0, own=1.0)
    tuner.tick()
    assert tuner.threads == 2 and m.set_to == [1, 2]


def test_a_single_busy_window_does_not_change_the_count():
    m = _Machine()
    tuner = m.tuner()
    for others in (0.0, 1.5, 0.0, 1.5, 0.0):
        m.run(1.0, others=others, own=0.5)
        tuner.tick()
    assert m.set_to == [] and tuner.threads == 2


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


@pytest.mark.parametrize("name", ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"])
def test_the_core_process_caps_onednn_s_caches_unless_told(monkeypatch, name):
    from asyncllm.engine.host_launcher import CPU_CACHE_CAPACITIES, core_env

    monkeypatch.delenv(name, raising=False)
    assert core_env()[name] == CPU_CACHE_CAPACITIES[name] == "16"
    monkeypatch.setenv(name, "512")
    assert core_env()[name] == "512"


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
