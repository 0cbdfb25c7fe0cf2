"""The grammar-mask kernel and the CPU path against their torch reference (and all
against a plain loop over the bits): rows in any order, a subset of the logits' rows, a
vocabulary that is not a multiple of 32, one wider and one narrower than the bitmask."""

from __future__ import annotations

import pytest
import torch

from asyncllm.sample.ops import apply_token_bitmask_cpu
from asyncllm_kernels.bitmask import apply_token_bitmask_
from asyncllm_kernels.reference import apply_token_bitmask_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, vocab: int, words: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(rows * vocab + words)
    logits = torch.randn(rows + 2, vocab, generator=gen).to(dtype).to(device)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64)
    bitmask = bits.to(torch.int32).to(device)
    target = torch.randperm(rows + 2, generator=gen)[:rows].to(device)
    return logits, target, bitmask


def _by_loop(logits, target, bitmask):
    want = logits.clone().cpu()
    masks = bitmask.cpu()
    for i, row in enumerate(target.tolist()):
        for t in range(logits.shape[1]):
            word = int(masks[i, t // 32]) & 0xFFFFFFFF if t // 32 < masks.shape[1] else 0
            if not (word >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    return want


@pytest.mark.parametrize("rows,vocab,words", [(1, 64, 2), (3, 1100, 35), (4, 2100, 60)])
def test_the_kernel_masks_what_the_reference_and_a_loop_mask(rows, vocab, words):
    logits, target, bitmask = _case(rows, vocab, words, torch.float32, DEVICE)
    got, ref = logits.clone(), logits.clone()
    apply_token_bitmask_(got, target, bitmask)
    apply_token_bitmask_ref(ref, target, bitmask)
    assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(got.cpu(), _by_loop(logits, target, bitmask))
    assert bool(torch.isinf(got).any()) and bool(torch.isfinite(got).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab,words", [(1, 64, 2), (3, 1100, 35), (4, 2100, 60), (2, 40, 2)])
def test_the_cpu_path_masks_what_the_reference_and_a_loop_mask(rows, vocab, words, dtype):
    logits, target, bitmask = _case(rows, vocab, words, dtype, "cpu")
    logits[0, :3] = torch.tensor([float("inf"), float("-inf"), 0.0], dtype=dtype)
    in_line = torch.arange(1, rows + 1)  # (a run of rows: masked where they lie)
    for where in (target, in_line):
        got, ref = logits.clone(), logits.clone()
        apply_token_bitmask_cpu(got, where, bitmask)
        apply_token_bitmask_ref(ref, where, bitmask)
        assert torch.equal(got, ref)
        assert torch.equal(got, _by_loop(logits, where, bitmask))
        untouched = [r for r in range(rows + 2) if r not in where.tolist()]
        assert torch.equal(got[untouched], logits[untouched])
    with pytest.raises(TypeError, match="int32"):
        apply_token_bitmask_cpu(logits, target, bitmask.to(torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_cpu(logits, target[:-1], bitmask)


def test_bad_shapes_and_dtypes_are_refused():
    logits, target, bitmask = _case(2, 64, 2, torch.float32, DEVICE)
    with pytest.raises(TypeError, match="int32"):
        apply_token_bitmask_(logits, target, bitmask.to(torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_(logits, target[:1], bitmask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_vocabulary_sized_rows_in_a_cuda_graph(dtype):
    """SmolLM2's vocabulary (49152) and a padded one (49157, wider than the bitmask),
    64 rows, then the kernel captured in a CUDA graph and replayed on new masks."""
    for vocab in (49152, 49157):
        logits, target, bitmask = _case(64, vocab, 1536, dtype, "cuda")
        got, ref = logits.clone(), logits.clone()
        apply_token_bitmask_(got, target, bitmask)
        apply_token_bitmask_ref(ref, target, bitmask)
        assert torch.equal(got, ref)
    logits, target, bitmask = _case(64, 49152, 1536, dtype, "cuda")
    work = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask_(work, target, bitmask)
    _, _, fresh = _case(64, 49152, 1536, dtype, "cuda")
    bitmask.copy_(torch.roll(fresh, 1, 0))
    work.copy_(logits)
    graph.replay()
    ref = logits.clone()
    apply_token_bitmask_ref(ref, target, bitmask)
    assert torch.equal(work, ref)
