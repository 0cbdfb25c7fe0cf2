"""The check after the CUDA graphs are captured: graphs that took more than estimated
before the KV cache was sized are a warning while the device keeps its free margin on
top of the activation peak, and a GraphMemoryError once they would eat into it."""

from __future__ import annotations

import pytest

from asyncllm.worker.worker import (
    FREE_MARGIN,
    GRAPH_POOL_SLACK,
    GraphMemoryError,
    check_graph_memory,
)

MiB = 1 << 20


def test_graphs_within_the_estimate_pass_silently():
    assert check_graph_memory(300 * MiB, 296 * MiB, free=10 << 30, activation_peak=1 << 30) is None
    # (the slack covers the allocator's rounding)
    taken = 296 * MiB + GRAPH_POOL_SLACK
    assert check_graph_memory(taken, 296 * MiB, free=0, activation_peak=0) is None


def test_an_overrun_with_room_left_is_a_warning_naming_both_sizes():
    # Qwen3-30B-A3B on an H100: 486 MiB of graphs against 296 estimated, gigabytes free
    warning = check_graph_memory(486 * MiB, 296 * MiB, free=7 << 30, activation_peak=2 << 30)
    assert warning is not None
    assert "486 MiB" in warning and "296 MiB" in warning and "190 MiB" in warning
    assert "gpu_memory_utilization" in warning


def test_an_overrun_into_the_free_margin_fails_start_up():
    peak = 2 << 30
    with pytest.raises(GraphMemoryError, match="486 MiB.*296 MiB"):
        check_graph_memory(486 * MiB, 296 * MiB, free=peak + FREE_MARGIN - 1, activation_peak=peak)
    warning = check_graph_memory(
        486 * MiB, 296 * MiB, free=peak + FREE_MARGIN, activation_peak=peak
    )
    assert warning is not None
