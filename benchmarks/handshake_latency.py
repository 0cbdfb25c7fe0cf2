"""How long the device takes to see a flag the host sets (cuStreamWaitValue32 on the
grammar's shared memory), from this process and from another one, and whether a wait
queued before the mask's copy holds it. Prints each figure."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, GrammarSync
from asyncllm.structured.manager import _Shared
from asyncllm.worker.grammar_handshake import GrammarHandshake
from asyncllm.worker.mask_staging import MaskStaging

CHILD = r"""
import mmap, sys, numpy as np
fd, size, at, n = map(int, sys.argv[1:5])
m = mmap.mmap(fd, size)
f = np.frombuffer(m, dtype=np.uint32, count=32, offset=at)
f[31] = 7  # (mapped and looking; the flags start at 1)
for _ in range(n):
    seq = int(f[0]) + 0
    while int(f[0]) == seq:
        pass
    f[16] = f[0]
"""


def main() -> None:
    s = _Shared(8, 37, pin=True)
    print("pinned", s.pinned, "device_steps", s.device_steps)
    hs = GrammarHandshake()
    flags = s.flags_np
    # 1. same process: the host sets the mask flag 2 ms after the wait was queued
    lat = []
    for _ in range(20):
        seq = int(flags[MASK_FLAG]) + 1
        hs.wait_for_masks(GrammarSync(seq, [], s.tokens, s.flags))
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.002)
        held = not done.query()
        t0 = time.perf_counter()
        flags[MASK_FLAG] = seq
        while not done.query():
            pass
        lat.append((time.perf_counter() - t0) * 1e6)
        assert held, "the wait did not hold"
    print(
        f"same process: release seen in median {statistics.median(lat):.1f} µs, max {max(lat):.1f}"
    )
    # 2. the mask copy behind a wait, the bitmask written after it was queued
    staging = MaskStaging(4, torch.device("cuda"))
    staging.reserve(6, 37)  # (before any wait: pinned allocations may wait for the device)
    masks = s.buffers[0][:6]
    masks.fill_(0)
    seq = int(flags[MASK_FLAG]) + 1
    hs.wait_for_masks(GrammarSync(seq, [], s.tokens, s.flags))
    _, dev, _ = staging.to_device(masks, None, list(range(6)))
    seen = dev.clone()
    done = torch.cuda.Event()
    done.record()
    held = not done.query()
    want = np.random.default_rng(seq).integers(0, 2**31 - 1, (6, 37)).astype(np.int32)
    masks.copy_(torch.from_numpy(want))
    flags[MASK_FLAG] = seq
    done.synchronize()
    print("mask copy: held", held, "equal", torch.equal(seen.cpu(), masks))
    # 3. another process answers each tokens flag with the mask flag; the device waits
    n = 2000
    flags_at = s.flags.data_ptr() - s.buffers[0].data_ptr()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            str(s.file.fileno()),
            str(flags_at + 128),
            str(flags_at),
            str(n),
        ],
        pass_fds=(s.file.fileno(),),
    )
    while int(flags[31]) != 7:  # (the child has mapped the memory)
        time.sleep(0.001)
    x = torch.zeros(64, device="cuda")
    none = torch.empty(0, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    base = int(flags[TOKENS_FLAG])
    for i in range(1, n + 1):
        sync = GrammarSync(base + i, [], s.tokens, s.flags)
        x += 1
        hs.give_tokens(sync, none, none)
        hs.wait_for_masks(sync)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / n * 1e6
    child.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        x += 1
    torch.cuda.synchronize()
    alone = (time.perf_counter() - t0) / n * 1e6
    print(f"round trip through another process: {per:.1f} µs a step; the kernel alone {alone:.1f}")
    s.close()


main()
