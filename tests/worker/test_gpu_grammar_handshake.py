"""A device step's handshake on CUDA, in the structured manager's shared memory: the
device writes the tokens ahead and their flag in stream order, and waits for the mask
flag before it copies the bitmask, which the host writes only after the copy was
queued."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, GrammarSync, flag_reached
from asyncllm.structured.manager import _Shared
from asyncllm.worker.grammar_handshake import GrammarHandshake
from asyncllm.worker.mask_staging import MaskStaging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
WORDS = 37


@pytest.fixture
def shared():
    s = _Shared(8, WORDS, pin=True)
    assert s.pinned and s.device_steps
    # (a test that fails with the device still waiting ends failed, not hung: its flags
    # are let go after a while, and by close())
    watchdog = threading.Timer(60, lambda: s.flags_np.__iadd__(np.uint32(1 << 30)))
    watchdog.start()
    yield s
    watchdog.cancel()
    s.close()


def test_the_device_hands_its_tokens_over_in_stream_order(shared):
    hs = GrammarHandshake()
    flags = shared.flags_np
    for seq in (2, 3):
        sync = GrammarSync(seq, ["a", "b", "c"], shared.tokens, shared.flags)
        x = torch.full((1024, 1024), 1 / 1024, device="cuda")
        for _ in range(8):  # (work before the tokens: they come after it; x @ x is x)
            x = x @ x
        sampled = (x[0, :5] * 1024 * seq).round().to(torch.int64) + torch.arange(5, device="cuda")
        hs.give_tokens(sync, sampled, torch.tensor([4, 0, 2], device="cuda"))
        torch.cuda.synchronize()
        assert flag_reached(int(flags[TOKENS_FLAG]), seq)
        assert shared.tokens[:3].tolist() == [seq + 4, seq, seq + 2]
    for seq in (5, 6):  # rows in line: the copy and the flag on the side stream
        sync = GrammarSync(seq, ["a", "b", "c"], shared.tokens, shared.flags)
        x = torch.full((1024, 1024), 1 / 1024, device="cuda")
        for _ in range(8):
            x = x @ x
        sampled = (x[0, :5] * 1024 * seq).round().to(torch.int64) + torch.arange(5, device="cuda")
        hs.give_tokens(sync, sampled, torch.tensor([1, 2, 3], device="cuda"), start=1)
        torch.cuda.synchronize()
        assert flag_reached(int(flags[TOKENS_FLAG]), seq)
        assert shared.tokens[:3].tolist() == [seq + 1, seq + 2, seq + 3]
    sync = GrammarSync(7, [], shared.tokens, shared.flags)
    none = torch.empty(0, dtype=torch.int64, device="cuda")
    hs.give_tokens(sync, none, none, start=0)  # (no tokens ahead: the flag alone)
    torch.cuda.synchronize()
    assert int(flags[TOKENS_FLAG]) == 7


def test_the_device_waits_for_a_bitmask_written_after_its_copy_was_queued(shared):
    staging = MaskStaging(4, torch.device("cuda"))
    staging.reserve(6, WORDS)  # (as the runner: pinned allocations may wait for the device)
    hs = GrammarHandshake()
    flags = shared.flags_np
    masks = shared.buffers[0][:6]
    masks.fill_(0)
    seq = int(flags[MASK_FLAG]) + 1
    sync = GrammarSync(seq, [], shared.tokens, shared.flags)
    hs.wait_for_masks(sync)
    rows, dev_masks, read = staging.to_device(masks, None, list(range(6)))
    seen = dev_masks.clone()
    done = torch.cuda.Event()
    done.record()
    assert read and not done.query()  # (the device waits for the flag)
    want = np.random.default_rng(seq).integers(-(2**31), 2**31 - 1, (6, WORDS), dtype=np.int64)
    masks.copy_(torch.from_numpy(want.astype(np.int32)))
    flags[MASK_FLAG] = seq
    done.synchronize()
    assert torch.equal(seen.cpu(), masks)
    assert torch.equal(rows.cpu(), torch.arange(6))


def test_the_forward_runs_on_while_the_bitmask_copy_waits_for_its_flag(shared):
    """`copy_when_filled`: the wait for the flag and the bitmask's copy are on the
    handshake's side stream; work queued on the current stream between the hand-over and
    it runs meanwhile, work queued after waits for the copy, which reads the bitmask as
    filled."""
    staging = MaskStaging(6, torch.device("cuda"))
    staging.reserve(6, WORDS)
    hs = GrammarHandshake()
    flags = shared.flags_np
    masks = shared.buffers[1][:6]
    masks.fill_(0)
    seq = max(int(flags[MASK_FLAG]), int(flags[TOKENS_FLAG])) + 1
    sync = GrammarSync(seq, ["a"], shared.tokens, shared.flags)
    sampled = torch.full((2,), 9, dtype=torch.int64, device="cuda")
    hs.give_tokens(sync, sampled, torch.tensor([1], device="cuda"))
    x = torch.ones(256, 256, device="cuda")
    for _ in range(4):
        x = x @ x / 256  # (the forward: queued before the wait, it need not wait)
    forward_done = torch.cuda.Event()
    forward_done.record()
    hs.copy_when_filled(sync, staging.direct_buffer(6, WORDS), masks)
    seen = staging._dev_masks[:6].clone()  # (queued after: waits for the copy)
    after = torch.cuda.Event()
    after.record()
    forward_done.synchronize()  # (returns although the flag is not set)
    assert flag_reached(int(flags[TOKENS_FLAG]), seq) and shared.tokens[0] == 9
    assert not after.query()
    want = np.random.default_rng(seq).integers(-(2**31), 2**31 - 1, (6, WORDS), dtype=np.int64)
    masks.copy_(torch.from_numpy(want.astype(np.int32)))
    flags[MASK_FLAG] = seq
    after.synchronize()
    assert torch.equal(seen.cpu(), masks) and torch.equal(x.cpu(), torch.ones(256, 256))
