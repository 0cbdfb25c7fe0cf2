"""Every CUDA attention backend through the backend interface (`build_metadata`, then
`forward`) against the float32 reference, on random bf16 cases drawn as the Triton
kernel's own tests draw them (decode, prefill, mixed; shuffled block tables; GQA; head
sizes 64, 128, 256), and a captured decode graph replayed after its lengths and block
tables changed in place. A backend whose library is not installed is skipped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncllm.model.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from asyncllm.model.attention.registry import (
    AttentionCGSupport,
    AttentionNeeds,
    find_attention_backend,
)
from asyncllm_kernels.reference import paged_attention_ref
from tests.kernels.attention_cases import AttentionCase, make_case
from tests.kernels.test_gpu_attention import _draw, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BACKENDS = ["triton", "flashinfer", "flashinfer_prefill", "flash_attn"]


def _entry(name: str):
    try:
        return find_attention_backend(name, AttentionNeeds(torch.device("cuda")))
    except ValueError as e:
        if "not installed" in str(e):  # (an optional extra: flashinfer, flash-attn)
            pytest.skip(f"the {name} backend's library is not installed here: {e}")
        raise


def _backend(name: str):
    return _entry(name).load()


def _common(case: AttentionCase, block_size: int, for_cuda_graph: bool = False):
    """The case's batch as the model runner describes it (nothing is written: every
    slot is -1, the cache holds the case's keys already)."""
    qsl = case.query_start_loc.cpu().numpy()
    seq_lens = case.seq_lens.cpu().numpy()
    common = CommonAttentionMetadata.from_numpy(
        qsl, seq_lens, case.block_table.cpu().numpy(),
        np.full(case.q.shape[0], -1, dtype=np.int64), "cuda",
    )  # fmt: skip
    common.for_cuda_graph = for_cuda_graph
    return common


def _run(backend, case: AttentionCase, spec: AttentionLayerSpec, block_size: int):
    kv = torch.stack([case.key_cache, case.value_cache])
    md = backend.build_metadata(_common(case, block_size), block_size)
    k = torch.zeros(case.q.shape[0], spec.num_kv_heads, spec.head_size, dtype=case.q.dtype)
    return backend.forward(spec, case.q, k.cuda(), k.cuda(), kv, md)


def _spec(p: dict) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=p["num_kv_heads"] * p["group"],
        num_kv_heads=p["num_kv_heads"],
        head_size=p["head_size"],
        scale=p["head_size"] ** -0.5,
        sliding_window=p["window"],
        logits_soft_cap=p["cap"],
    )


# Seeds of `_draw` (the Triton kernel's random cases). FlashInfer compiles a kernel
# module per head size, window and soft-cap use, and decode or prefill (20-80 s each on
# first use), so the cases are chosen to cover each once: head sizes 64 and 128 with GQA
# groups 1 to 8, decodes, prefills, mixed batches and padding rows, no window or cap...
PLAIN_SEEDS = [2, 6, 8, 9, 12, 18, 19, 29, 30, 34, 36, 39, 49]
# ...then head size 256, windows and soft-caps (decode and prefill).
FEATURE_SEEDS = [1, 5, 22, 23, 24, 26, 33, 42, 46, 47]


@pytest.mark.parametrize("seed", PLAIN_SEEDS + FEATURE_SEEDS)
@pytest.mark.parametrize("name", BACKENDS)
def test_random_case_bf16(name, seed):
    backend = _backend(name)
    p = _draw(seed)
    case = make_case(
        p["seqs"], p["num_kv_heads"], p["group"], p["head_size"], p["block_size"],
        torch.bfloat16, "cuda", seed=seed, pad_seqs=seed % 3, pad_tokens=seed % 2,
    )  # fmt: skip
    out = _run(backend, case, _spec(p), p["block_size"])
    torch.cuda.synchronize()
    n = case.num_tokens
    assert not out[:n].isnan().any(), "NaN outputs"
    want = paged_attention_ref(
        *(t.float() if t.is_floating_point() else t for t in case.args()),
        scale=p["head_size"] ** -0.5, sliding_window=p["window"], soft_cap=p["cap"],
    )  # fmt: skip
    err = rel_err(out[:n], want[:n])
    assert err <= 1e-2, f"{name}: {p['seqs'][:4]}... {p} rel err {err:.2e}"


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("name", BACKENDS)
def test_decode_graph_replays_new_lengths_and_tables(name, group):
    """A decode batch captured once; then new lengths, block tables, queries and caches
    are written into the same buffers and the metadata rebuilt (a backend that plans on
    the host plans again): each replay computes the new batch."""
    entry = _entry(name)
    if entry.cudagraph_support is AttentionCGSupport.NEVER:
        pytest.skip(f"the {name} backend declares no CUDA graphs")
    backend = entry.load()
    size, block_size, width = 8, 16, 200
    spec = AttentionLayerSpec(num_heads=2 * group, num_kv_heads=2, head_size=128, scale=128**-0.5)

    def draw(seed: int) -> AttentionCase:
        r = random.Random(seed)
        seqs = [(1, 1 + r.randint(0, 3000)) for _ in range(size - 2)]
        return make_case(
            seqs, 2, group, 128, block_size, torch.bfloat16, "cuda", seed=seed, pad_seqs=2,
            pad_tokens=2, spare_blocks=1200 - sum(-(-n // block_size) for _, n in seqs),
        )  # fmt: skip

    first = draw(0)
    q = torch.zeros_like(first.q)  # (6 decodes' rows, then the 2 padding rows)
    kv = torch.stack([first.key_cache, first.value_cache])
    host_table = np.zeros((size, width), dtype=np.int32)
    qsl = np.arange(size + 1, dtype=np.int32)
    seq_lens = np.zeros(size, dtype=np.int32)
    dev = {
        "qsl": torch.zeros(size + 1, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.zeros(size, dtype=torch.int32, device="cuda"),
        "table": torch.zeros(size, width, dtype=torch.int32, device="cuda"),
        "slots": torch.full((size,), -1, dtype=torch.int64, device="cuda"),
    }
    zeros = torch.zeros(size, 2, 128, dtype=torch.bfloat16, device="cuda")

    def write(case: AttentionCase):
        """The case into the fixed buffers (host and device), as the runner does."""
        host_table[:] = 0
        bt = case.block_table.cpu().numpy()
        host_table[:, : bt.shape[1]] = bt
        seq_lens[:] = case.seq_lens.cpu().numpy()
        qsl[:] = case.query_start_loc.cpu().numpy()
        q.copy_(case.q)
        kv[0].copy_(case.key_cache)
        kv[1].copy_(case.value_cache)
        dev["qsl"].copy_(torch.from_numpy(qsl))
        dev["seq_lens"].copy_(torch.from_numpy(seq_lens))
        dev["table"].copy_(torch.from_numpy(host_table))
        common = CommonAttentionMetadata(
            query_start_loc=dev["qsl"], seq_lens=dev["seq_lens"], block_table=dev["table"],
            slot_mapping=dev["slots"], query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            num_actual_tokens=size, max_query_len=1, max_seq_len=int(seq_lens.max()),
            block_table_cpu=host_table, for_cuda_graph=True,
        )  # fmt: skip
        return backend.build_metadata(common, block_size)

    md = write(first)
    out = torch.empty_like(q)

    def run(metadata):
        out.copy_(backend.forward(spec, q, zeros, zeros, kv, metadata))

    run(md)  # eager: compiles, plans
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(md)
    for seed in (1, 2, 3):
        new = draw(seed)
        write(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = paged_attention_ref(*new.args(), scale=128**-0.5)
        n = size - 2
        assert rel_err(out[:n], want[:n]) <= 1e-2, f"{name} seed {seed}"
