"""The small-batch GEMM's fused variants, as the decoder layers launch them, and the
mixture-of-experts layer's small-batch GEMMs, at the tiles `small_configs` gives, compile
for sm_90 without spilling registers. No GPU is needed: Triton compiles for a named target
with its own ptxas, whose `-v` report gives the registers and the spill stores. (The
compiling runs in a child process: the CPU suite runs Triton's interpreter, set when a
kernel module is imported.)

A kernel that spills moves its registers through local memory beside its weight's
stream; the first fused forms (the squares summed in the GEMM's loop, 512-long K tiles)
spilled up to 916 bytes a thread. (That form was slow for a second reason too: without
spills, at 256-long tiles, it still took 1.5-4x the time of the squares in a pass of
their own: docs/benchmarks.md.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from asyncllm_kernels.fused_moe import small_configs
from asyncllm_kernels.skinny_gemm import fused_config

ROOT = Path(__file__).resolve().parents[2]
# The dense layers of the benchmark shapes (n counts a gated w's gate and up rows):
# Llama-3.1-8B's and Qwen3-0.6B's qkv and gate/up (a norm before them), o_proj and down
# (an add after them)
LAYERS = [
    ("qkv", 6144, 4096),
    ("gate_up", 28672, 4096),
    ("o", 4096, 4096),
    ("down", 4096, 14336),
    ("qkv", 4096, 1024),
    ("gate_up", 6144, 1024),
    ("o", 1024, 2048),
    ("down", 1024, 3072),
]
# (BLOCK_N, BLOCK_K, warps, stages, NORM, GATED, ADD, M is 1): tiles too large for the
# registers, which the check must see spill
SPILLING = (128, 512, 4, 3, True, True, False, True)
# Under PDL (a ninth entry), with the weights' L2 prefetch before the wait: the dot form,
# gated, and the one-row form
UNDER_PDL = [
    (32, 512, 4, 3, False, False, False, True, True),
    (32, 256, 4, 4, True, True, False, True, True),
    (16, 128, 4, 6, False, False, True, False, True),
    (2, 2048, 4, 1, False, False, False, True, True),
    (4, 1024, 4, 1, True, True, True, True, True),
]


def launched_variants() -> list[tuple]:
    """The variants `_small_batch` launches for M = 1 and M = 2..16 (Triton compiles
    M = 1 as a kernel of its own)."""
    variants = set()
    for part, n, k in LAYERS:
        gated, norm, add = part == "gate_up", part in ("qkv", "gate_up"), part in ("o", "down")
        for m in (1, 16):
            cfg = fused_config(m, n, k, torch.bfloat16, gated, norm=norm)
            variants.add(
                (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
                + (norm, gated, add, m == 1)
            )
    return sorted(variants)


# The mixture-of-experts layer's small-batch GEMMs at 1, 2 and 4 tokens:
# (kernel, BLOCK_N, BLOCK_K, warps, stages, TOP_K) for Qwen3-30B-A3B's 8 experts a token
# of 128 and DeepSeek-V2-Lite's 6 of 64
MOE_VARIANTS = sorted(
    {
        (kernel, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, top_k)
        for tokens in (1, 2, 4)
        for kernel, cfg in zip(
            ("_small_gate_up_gemm_kernel", "_small_down_gemm_kernel"), small_configs(tokens)
        )
        for top_k in (6, 8)
    }
)
_TYPES = {"eps": "fp32", "scaling": "fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32"}


def compile_report(*variant) -> str:
    """ptxas -v's report of a variant (a skinny GEMM's or a `MOE_VARIANTS` entry) compiled
    for sm_90a, with the alignment the JIT assumes of the layers' tensors (pointers,
    strides, N and K divisible by 16). Runs without Triton's interpreter."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    import asyncllm_kernels.fused_moe as fused_moe
    from asyncllm_kernels.skinny_gemm import _skinny_gemm_kernel

    if isinstance(variant[0], str):
        name, bn, bk, warps, stages, top_k = variant
        kernel, m1 = getattr(fused_moe, name), False
        constexprs = dict(BLOCK_N=bn, BLOCK_K=bk, TOP_K=top_k, PRECISION="tf32")
        if name == "_small_gate_up_gemm_kernel":  # (routing its tokens, as the layers launch it)
            constexprs.update(ROUTE=True, RENORMALIZE=True, ROUND=tl.bfloat16)
            constexprs.update(BLOCK_E=128 if top_k == 8 else 64, BY_RANK=True)
    else:
        # (a ninth entry, if any: under PDL, with the weights' L2 prefetch)
        bn, bk, warps, stages, norm, gated, add, m1, *under_pdl = variant
        kernel = _skinny_gemm_kernel
        on = bool(under_pdl and under_pdl[0])
        constexprs = dict(BLOCK_N=bn, BLOCK_K=bk, NORM=norm, GATED=gated, ADD=add, PDL=on)
        constexprs.update(ROWS=16 if bn >= 16 else 1, PREFETCH=on)
    params = kernel.params
    signature = {
        p.name: "constexpr"
        if p.is_constexpr or (p.name == "M" and m1)
        else _TYPES.get(p.name, "*bf16" if "ptr" in p.name else "i32")
        for p in params
    }
    aligned = [
        i
        for i, p in enumerate(params)
        if "ptr" in p.name or p.name.startswith("stride") or p.name in ("N", "K")
    ]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={**constexprs, **({"M": 1} if m1 else {})},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
            check=True,
        )
    prefetches = compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2")
    return out.stdout + out.stderr + f"\nL2 prefetch instructions: {prefetches}\n"


@pytest.fixture(scope="module")
def reports() -> dict[tuple, str]:
    variants = [*launched_variants(), *MOE_VARIANTS, SPILLING, *UNDER_PDL]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "kernels"), str(ROOT / "tests" / "kernels")])
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-sm90-")
    out = subprocess.run(
        [sys.executable, __file__, json.dumps(variants)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return {tuple(v): r for v, r in json.loads(out.stdout)}


def spill_stores(report: str) -> int:
    found = re.search(r"(\d+) bytes spill stores", report)
    assert found, report
    return int(found.group(1))


def test_the_variants_cover_each_fusion_at_m1_and_above():
    kinds = {(norm, gated, add, m1) for *_, norm, gated, add, m1 in launched_variants()}
    for m1 in (True, False):
        assert {
            (True, False, False, m1),
            (True, True, False, m1),
            (False, False, True, m1),
        } <= kinds


@pytest.mark.parametrize("variant", launched_variants(), ids=str)
def test_each_launched_variant_compiles_for_sm90_without_spills(reports, variant):
    assert spill_stores(reports[variant]) == 0, reports[variant]


@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=str)
def test_the_moe_small_batch_gemms_compile_for_sm90_without_spills(reports, variant):
    assert spill_stores(reports[variant]) == 0, reports[variant]


@pytest.mark.parametrize("variant", UNDER_PDL, ids=str)
def test_under_pdl_the_weights_prefetch_into_l2_without_spills(reports, variant):
    """The prefetch compiles (ptxas takes sm_90's bulk prefetch) into both forms, once
    per weight block (twice gated); without PDL there is none."""
    report = reports[variant]
    assert spill_stores(report) == 0, report
    gated = variant[5]
    assert f"L2 prefetch instructions: {2 if gated else 1}" in report, report
    assert "L2 prefetch instructions: 0" in reports[SPILLING]


def test_the_check_sees_a_kernel_that_spills(reports):
    assert spill_stores(reports[SPILLING]) > 0, reports[SPILLING]


if __name__ == "__main__":  # (the fixture's child: variants in, reports out, as JSON)
    print(json.dumps([[v, compile_report(*v)] for v in json.loads(sys.argv[1])]))
