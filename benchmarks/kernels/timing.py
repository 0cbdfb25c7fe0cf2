"""Timing helpers for kernel microbenchmarks on one CUDA device (numbers quoted for an H200).

A kernel is timed inside a CUDA graph, so launch overhead on the host is left out, over
several independent input sets (rotations) so that, where the sizes allow, the working
set exceeds L2 and every call reads from and writes to device memory. Each graph replay
is timed on its own with CUDA events and the median is reported, per call.

    us = graph_time_us(lambda: (torch.randn(n, device="cuda"),), torch.neg)
    print(us, floor_us(2 * 4 * n))
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# Device-to-device copy bandwidth (bytes read + bytes written per second) measured on the
# H200 we benchmark on; `measure_copy_bw` gives this machine's value.
COPY_BW = 4.3e12

Inputs = tuple[Any, ...] | dict[str, Any]


def floor_us(bytes_moved: float) -> float:
    """The time, in microseconds, to move `bytes_moved` bytes at COPY_BW."""
    return bytes_moved / COPY_BW * 1e6


def _call(fn: Callable[..., Any], inputs: Inputs) -> Any:
    return fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)


def _median_us_per_call(launch: Callable[[], Any], calls: int, replays: int, warmup: int) -> float:
    """Median over `replays` event-timed runs of `launch()`, divided by `calls`."""
    for _ in range(warmup):
        launch()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    return ms * 1e3 / calls


def graph_time_us(
    make_inputs: Callable[[], Inputs],
    fn: Callable[..., Any],
    rotations: int = 8,
    replays: int = 50,
    warmup: int = 3,
) -> float:
    """Median microseconds per call of `fn(*make_inputs())` (or `fn(**make_inputs())`).

    `rotations` input sets are built with `make_inputs()`, `fn` is run once on each (to
    compile and warm up, on a side stream), then one CUDA graph calling `fn` on every set
    in turn is captured. After `warmup` replays, `replays` replays are timed one by one;
    the median replay time divided by `rotations` is returned. `fn` must be capturable
    (no host synchronisation, fixed shapes); in-place updates simply repeat per replay.
    """
    sets = [make_inputs() for _ in range(rotations)]
    try:
        return graph_time_calls_us([lambda i=i: _call(fn, i) for i in sets], replays, warmup)
    finally:
        sets.clear()
        torch.cuda.empty_cache()


def graph_time_calls_us(
    calls: Sequence[Callable[[], Any]], replays: int = 50, warmup: int = 3
) -> float:
    """Median microseconds per call of one CUDA graph that runs every zero-argument call
    in `calls` once (each call is run once beforehand, on a side stream, to compile and
    warm up). The calls' outputs are kept alive while the graph exists, so each call in
    the graph writes its own buffer."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    try:
        return _median_us_per_call(graph.replay, len(calls), replays, warmup)
    finally:
        del graph, outs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def eager_time_us(
    make_inputs: Callable[[], Inputs],
    fn: Callable[..., Any],
    rotations: int = 8,
    replays: int = 50,
    warmup: int = 3,
) -> float:
    """As `graph_time_us`, for functions that cannot be captured (they synchronise with the
    host, e.g. boolean-mask indexing): the calls are launched eagerly, so the time includes
    whatever the host adds between kernels."""
    sets = [make_inputs() for _ in range(rotations)]
    for inputs in sets:
        _call(fn, inputs)
    torch.cuda.synchronize()

    def launch() -> None:
        for inputs in sets:
            _call(fn, inputs)

    try:
        return _median_us_per_call(launch, rotations, replays, warmup)
    finally:
        sets.clear()
        torch.cuda.empty_cache()


def measure_copy_bw(nbytes: int = 2 << 30, replays: int = 20) -> float:
    """Device-to-device copy bandwidth of this GPU in bytes/s (read + write), from a
    `nbytes` copy timed as `graph_time_us` does (one input set: it is far larger than L2).

    The copy is an elementwise kernel (`torch.neg` into the destination: each byte read
    once and written once). A same-dtype `copy_` would be captured as a memcpy node, which
    the graph runs on the copy engines: about 2.7 TB/s on an H200 against about 4.3 TB/s
    for a kernel (or for the same memcpy launched eagerly)."""
    n = nbytes // 2

    def make_inputs():
        src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        return torch.empty_like(src), src

    us = graph_time_us(
        make_inputs, lambda dst, src: torch.neg(src, out=dst), rotations=1, replays=replays
    )
    return 2 * n * 2 / (us * 1e-6)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def print_rows(rows: Sequence[dict[str, Any]], header: Sequence[str]) -> None:
    """Print `rows` (dicts) as a table with the columns `header`, in that order. Text is
    left-aligned and numbers right-aligned; a missing value prints as '-'."""
    cells = [[_fmt(row.get(col, "-")) for col in header] for row in rows]
    numeric = [
        all(isinstance(row.get(col), int | float) for row in rows if col in row) for col in header
    ]
    widths = [max([len(col)] + [len(c[i]) for c in cells]) for i, col in enumerate(header)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)
        ).rstrip()

    print(line(list(header)))
    print(line(["-" * w for w in widths]))
    for c in cells:
        print(line(c))


def write_json(name: str, rows: Sequence[dict[str, Any]], meta: dict | None = None) -> Path | None:
    """Write `{"meta": meta, "rows": rows}` to $OUT/<name>.json when OUT is set; return the
    path written, or None."""
    out = os.environ.get("OUT")
    if not out:
        return None
    path = Path(out) / f"{Path(name).stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta or {}, "rows": list(rows)}, indent=1) + "\n")
    return path


def device_meta() -> dict[str, Any]:
    """The device and library versions, for the JSON output."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
