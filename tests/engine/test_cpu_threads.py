"""How many torch threads the engine core uses on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncllm import EngineArgs
from asyncllm.engine.cpu_threads import default_cpu_threads, set_cpu_threads


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_default_leaves_the_busy_cpus_out():
    assert default_cpu_threads(cpus=8, load=0.3) == 8
    assert default_cpu_threads(cpus=8, load=2.7) == 6
    assert default_cpu_threads(cpus=2, load=5.0) == 1  # never fewer than one
    assert default_cpu_threads() >= 1


def test_own_process_takes_the_default_or_omp_num_threads(monkeypatch, keep_threads):
    config = SimpleNamespace(cpu_threads=None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("asyncllm.engine.cpu_threads.default_cpu_threads", lambda: 1)
    assert set_cpu_threads(config, own_process=True) == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(2)
    assert set_cpu_threads(config, own_process=True) is None  # torch read it at import
    assert torch.get_num_threads() == 2


def test_in_process_the_application_setting_stays_unless_cpu_threads_is_set(keep_threads):
    torch.set_num_threads(2)
    assert set_cpu_threads(SimpleNamespace(cpu_threads=None), own_process=False) is None
    assert torch.get_num_threads() == 2
    assert set_cpu_threads(SimpleNamespace(cpu_threads=1), own_process=False) == 1
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value,error", [(0, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_cpu_threads_are_named(value, error):
    with pytest.raises(error, match="cpu_threads"):
        EngineArgs(cpu_threads=value)
