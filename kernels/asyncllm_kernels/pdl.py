"""Programmatic dependent launch (PDL) for a decoder layer's kernels of this package, on
sm_90 and later: the KV cache write, RMSNorm, silu_and_mul, the rotary launch, paged
attention and its merge, and the skinny GEMM (not yet the MLA, MoE or bitmask kernels).

In a CUDA graph of a small decode step most kernels last a few microseconds, and the
time from one kernel's end to the next one's start is a visible share of the step.
With PDL on, each kernel here is launched with the programmatic stream-serialization
attribute: the next kernel's programs may be placed on the SMs once every program of
the current one has started, and wait there. Each kernel's programs begin with
`griddepcontrol.wait`, before they read anything, so nothing is read before the
previous kernel has finished and its writes are visible; then they signal
`griddepcontrol.launch_dependents`. A kernel that follows one launched without the
attribute (cuBLAS, torch's own) starts as it always did.

A kernel whose weights do not depend on the previous kernel (the skinny GEMM) may also
start moving them into L2 before its wait (`prefetch_l2`: one bulk prefetch per thread,
sm_90's `cp.async.bulk.prefetch.L2`), so that the programs placed early spend the
previous kernel's tail loading instead of idle.

Off by default: `enable(True)` turns it on for the process (the engine does so from
`ASYNCLLM_PDL=1`); it stays off on older GPUs and under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = False


def enable(on: bool) -> None:
    """Launch this package's kernels with PDL (where the GPU has it) from now on."""
    global _enabled
    _enabled = on


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def options(t: torch.Tensor) -> dict[str, Any]:
    """The launch keywords of a kernel whose inputs include `t`: its `PDL` constexpr and,
    where it is on, Triton's `launch_pdl` option."""
    if _enabled and t.is_cuda and _supported(t.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """A program's first step: wait for the previous kernel, then let the next one be
    placed (no-ops without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# (the most a program asks `prefetch_l2` for: with one or two programs an SM placed early,
# about the bytes in flight that hide a few microseconds of a kernel's tail)
PREFETCH_BYTES = tl.constexpr(64 << 10)


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Asks for `nbytes` (a multiple of 16, from `ptr`, 16-byte aligned) to be brought
    into L2, split over 128 lanes (threads past 128 repeat a lane's request): a hint with
    no result, for memory no earlier kernel writes. sm_90 and later."""
    chunk = (tl.cdiv(nbytes, 128) + 15) // 16 * 16
    offs = tl.arange(0, 128) * chunk
    size = tl.minimum(chunk, nbytes - offs)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr.to(tl.pointer_type(tl.int8)) + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def can_prefetch(t: torch.Tensor) -> bool:
    """Whether `prefetch_l2` may take t's rows: 16-byte aligned, each row too."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
