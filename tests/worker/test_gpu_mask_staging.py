"""MaskStaging on CUDA: what reaches the device equals plain indexing of the host bitmask,
on the direct path (pinned, in order, every row), through the gather slots (rows in
another order, a subset, an unpinned bitmask), and with steps queued back to back."""

from __future__ import annotations

import pytest
import torch

from asyncllm.worker.mask_staging import MaskStaging

pytestmark = pytest.mark.gpu
WORDS = 37


def _bitmask(rows: int, seed: int, pinned: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, WORDS), generator=gen, dtype=torch.int64)
    out = bits.to(torch.int32)
    return out.pin_memory() if pinned else out


@pytest.mark.parametrize(
    "pinned, mask_rows, logit_rows",
    [
        (True, None, [0, 1, 2, 3, 4, 5]),  # direct: one copy, rows an arange
        (True, None, [0, 2, 3, 5, 6, 9]),  # direct masks, rows through a slot
        (True, [5, 0, 3, 1, 2, 4], [0, 1, 2, 3, 4, 5]),  # gathered masks
        (False, None, [0, 1, 2, 3, 4, 5]),  # unpinned: through a slot
        (False, [1, 0], [7, 3]),
    ],
)
def test_to_device_equals_plain_indexing(pinned, mask_rows, logit_rows):
    staging = MaskStaging(4, torch.device("cuda"))  # (grows past its first capacity)
    for seed in range(3):  # (steps back to back: each reads its own masks)
        host = _bitmask(6, seed, pinned)
        rows, masks, read = staging.to_device(host, mask_rows, logit_rows)
        done = torch.cuda.Event()
        done.record()
        want_masks = host[: len(logit_rows)] if mask_rows is None else host[mask_rows]
        assert torch.equal(rows.cpu(), torch.tensor(logit_rows))
        assert torch.equal(masks.cpu(), want_masks)
        # Read by a pending copy exactly when the host bitmask goes as it is
        assert read == (pinned and mask_rows is None)
        done.synchronize()


def test_apply_graphed_equals_the_reference_each_replay():
    """The graph of the copy and the kernel reads its bitmask anew at each replay (two
    pinned sources taken in turn, as the scheduler's), and masks like the reference;
    an unpinned bitmask is refused, touching nothing."""
    from asyncllm_kernels.reference import apply_token_bitmask_ref

    vocab, rows = 32 * WORDS - 5, 6
    staging = MaskStaging(4, torch.device("cuda"))
    logits = torch.empty(8, vocab, device="cuda")  # (a fixed buffer, as the graphs' logits)
    sources = [_bitmask(rows, 100 + k, pinned=True) for k in range(2)]
    for step in range(6):
        src = sources[step % 2]
        src.copy_(_bitmask(rows, step, pinned=False))  # (the fill writes it in place)
        base = torch.randn(8, vocab, generator=torch.Generator().manual_seed(step))
        logits.copy_(base)
        assert staging.apply_graphed(src, logits[:rows])
        want = base.clone()
        apply_token_bitmask_ref(want, torch.arange(rows), src.clone())
        torch.cuda.synchronize()
        assert torch.equal(logits.cpu(), want)
    assert len(staging._graphs) == 2
    logits.copy_(base)
    assert not staging.apply_graphed(_bitmask(rows, 9, pinned=False), logits[:rows])
    assert torch.equal(logits.cpu(), base)
