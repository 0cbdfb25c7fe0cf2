"""Probe: can the device wait on a flag another process writes in shared pinned memory
(cuStreamWaitValue32), and write one that process polls (cuStreamWriteValue32)? And the
round trip's cost. Prints results; run on the GPU machine."""

import ctypes
import mmap
import subprocess
import sys
import tempfile
import time

import torch

CHILD = r"""
import mmap, sys, time, numpy as np
fd, n = int(sys.argv[1]), int(sys.argv[2])
m = mmap.mmap(fd, 4096)
f = np.frombuffer(m, dtype=np.int32)
# f[0]: device -> child seq, f[16]: child -> device seq, f[32:32+64]: data
for seq in range(1, n + 1):
    while f[0] < seq:
        pass
    f[32:96] = f[32:96] + 1  # (work on the data the device wrote)
    f[16] = seq
"""


def main():
    lib = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    f = tempfile.TemporaryFile(dir="/dev/shm")
    f.truncate(4096)
    m = mmap.mmap(f.fileno(), 4096)
    host = torch.frombuffer(m, dtype=torch.int32)
    rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), 4096, 3)
    print("register", int(rc), "is_pinned", host.is_pinned())
    dptr = ctypes.c_uint64()
    r = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(host.data_ptr()), 0)
    print("devptr", r, hex(dptr.value), hex(host.data_ptr()))
    wait = lib.cuStreamWaitValue32_v2
    write = lib.cuStreamWriteValue32_v2
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    n = 2000
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(f.fileno()), str(n)], pass_fds=(f.fileno(),)
    )
    s = torch.cuda.current_stream()
    sp = ctypes.c_void_p(s.cuda_stream)
    data = torch.zeros(64, dtype=torch.int32, device="cuda")
    to_child = dptr.value
    from_child = dptr.value + 64
    t0 = time.perf_counter()
    for seq in range(1, n + 1):
        data += 1  # device work
        host[32:96].copy_(data, non_blocking=True)
        assert write(sp, to_child, seq, 0) == 0
        assert wait(sp, from_child, seq, 0) == 0  # GEQ
        data.copy_(host[32:96], non_blocking=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print("round trips", n, "µs each", dt / n * 1e6, "data[0]", int(data[0]), "expect", 2 * n)
    child.wait()
    # the same without the child: device only
    t0 = time.perf_counter()
    for _ in range(n):
        data += 1
        host[32:96].copy_(data, non_blocking=True)
        data.copy_(host[32:96], non_blocking=True)
    torch.cuda.synchronize()
    print("no handshake µs each", (time.perf_counter() - t0) / n * 1e6)
    # host release of a device wait
    assert wait(sp, from_child, 10**6, 0) == 0
    ev = torch.cuda.Event()
    ev.record()
    time.sleep(0.05)
    print("waiting device done?", ev.query())
    host[16] = 10**6
    ev.synchronize()
    print("released by host write: done", ev.query())


main()
