"""CUDA stream memory operations: the device waits for a 32-bit flag in host memory to
reach a value, or writes one there, in stream order (the driver's cuStreamWaitValue32
and cuStreamWriteValue32, through ctypes: torch does not expose them), and copies
between pinned host memory and the device as single driver calls on a given stream.

asyncllm's grammar handshake uses them (its structured/grammar_process.py): a constrained
step's sampling is queued with its forward and waits on the device for the flag the
grammar process sets once its bitmask is filled, and the device tells the grammar
process that the tokens it needs are in shared memory by writing another flag. The
host queues both and goes on; it is no longer a link of the chain from one step's
tokens to the next step's mask.

The flags live in memory registered with `cudaHostRegister(..., MAPPED)`; each is a
32-bit sequence number that only grows (compared as "at least", modulo 2**32).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and with
# a device address (the stream operations need one).
REGISTER_MAPPED = 1 | 2
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


@functools.cache
def _driver() -> Any:
    """The CUDA driver library with the functions used here typed, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        wait, write = lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2
        pointer, copy = lib.cuMemHostGetDevicePointer_v2, lib.cuMemcpyHtoDAsync_v2
        copy_back = lib.cuMemcpyDtoHAsync_v2
    except (OSError, AttributeError):
        return None
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    pointer.restype = ctypes.c_int
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy_back.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = copy_back.restype = ctypes.c_int
    return lib


def device_address(host_ptr: int) -> int:
    """The device's address of registered (mapped) host memory. RuntimeError if the
    driver refuses."""
    lib = _driver()
    if lib is None:
        raise RuntimeError("the CUDA driver library is not available")
    out = ctypes.c_uint64()
    rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {rc})")
    return int(out.value)


def _stream(stream: torch.cuda.Stream | None) -> ctypes.c_void_p:
    return ctypes.c_void_p((stream or torch.cuda.current_stream()).cuda_stream)


def wait_value(address: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Queues a wait on `stream` (the current one by default) until the 32-bit flag at
    device address `address` is at least `value`; the work queued after it runs then."""
    rc = _driver().cuStreamWaitValue32_v2(_stream(stream), address, value & 0xFFFFFFFF, _WAIT_GEQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")


def write_value(address: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Queues, on `stream`, the write of `value` to the 32-bit flag at device address
    `address`, after the work queued before it (and its memory writes) is done."""
    rc = _driver().cuStreamWriteValue32_v2(
        _stream(stream), address, value & 0xFFFFFFFF, _WRITE_DEFAULT
    )
    if rc != 0:
        raise RuntimeError(f"cuStreamWriteValue32 failed (CUresult {rc})")


def _nbytes(dst: torch.Tensor, src: torch.Tensor) -> int:
    nbytes = src.numel() * src.element_size()
    if (
        not (src.is_contiguous() and dst.is_contiguous())
        or dst.numel() * dst.element_size() != nbytes
    ):
        raise ValueError("a copy needs two contiguous tensors of the same size")
    return nbytes


def copy_to_device(
    dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None = None
) -> None:
    """Queues on `stream` the copy of `src` (contiguous, in pinned host memory) to `dst`
    (contiguous, on the device, as many bytes): one driver call, cheaper on the host
    than a torch copy, and without making `stream` the current one."""
    nbytes = _nbytes(dst, src)
    rc = _driver().cuMemcpyHtoDAsync_v2(
        dst.data_ptr(), ctypes.c_void_p(src.data_ptr()), nbytes, _stream(stream)
    )
    if rc != 0:
        raise RuntimeError(f"cuMemcpyHtoDAsync failed (CUresult {rc})")


def copy_to_host(
    dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None = None
) -> None:
    """Queues on `stream` the copy of `src` (contiguous, on the device) to `dst`
    (contiguous, in pinned host memory, as many bytes): one driver call."""
    nbytes = _nbytes(dst, src)
    rc = _driver().cuMemcpyDtoHAsync_v2(
        ctypes.c_void_p(dst.data_ptr()), src.data_ptr(), nbytes, _stream(stream)
    )
    if rc != 0:
        raise RuntimeError(f"cuMemcpyDtoHAsync failed (CUresult {rc})")


def usable(flag: torch.Tensor) -> bool:
    """Whether the stream operations work on `flag` (a registered int32 in host memory,
    holding a value of at least 1): a wait that is already met and a write of the same
    value, on a side stream, waited for."""
    if _driver() is None or not torch.cuda.is_available():
        return False
    try:
        address = device_address(flag.data_ptr())
        value = int(flag.item())
        side = torch.cuda.Stream()
        wait_value(address, value, side)
        write_value(address, value, side)
        side.synchronize()
    except RuntimeError:
        return False
    return int(flag.item()) == value
