"""The small-batch GEMM's fused variants, as the decoder layers launch them, compile for
sm_90 without spilling registers. No GPU is needed: Triton compiles for a named target
with its own ptxas, whose `-v` report gives the registers and the spill stores. (The
compiling runs in a child process: the CPU suite runs Triton's interpreter, set when a
kernel module is imported.)

A kernel that spills streams its weight several times slower than one that does not: the
first fused form (squares summed in the loop at 16 x 512 tiles) spilled 440 bytes a
thread and ran the 8B shape's decode at a third of the speed of the launches apart.
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
NORM_CODE = {None: 0, "loop": 1, "prepass": 2}
# (BLOCK_N, BLOCK_K, warps, stages, NORM, GATED, ADD, M is 1): the loop form at 16 x 512,
# gated, which `fused_config` avoids
SPILLING = (16, 512, 4, 3, NORM_CODE["loop"], True, False, True)


def launched_variants() -> list[tuple]:
    """The variants `_small_batch` launches for M = 1 and M = 2..16 (Triton compiles
    M = 1 as a kernel of its own)."""
    variants = set()
    for part, n, k in LAYERS:
        gated, norm, add = part == "gate_up", part in ("qkv", "gate_up"), part in ("o", "down")
        for m in (1, 16):
            cfg = fused_config(m, n, k, torch.bfloat16, gated, norm=norm)
            rows = "loop" if norm else None
            variants.add(
                (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
                + (NORM_CODE[rows], gated, add, m == 1)
            )
    return sorted(variants)


def compile_report(bn, bk, warps, stages, norm, gated, add, m1) -> str:
    """ptxas -v's report of the kernel compiled for sm_90a, with the alignment the JIT
    assumes of the layers' tensors (pointers, strides, N and K divisible by 16). Runs
    without Triton's interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from asyncllm_kernels.skinny_gemm import _skinny_gemm_kernel as kernel

    params = kernel.params
    signature = {
        p.name: "constexpr"
        if p.is_constexpr or (p.name == "M" and m1)
        else {"eps": "fp32"}.get(p.name, "*bf16" if "ptr" in p.name else "i32")
        for p in params
    }
    aligned = [
        i
        for i, p in enumerate(params)
        if "ptr" in p.name or p.name.startswith("stride") or p.name in ("N", "K")
    ]
    constexprs = dict(BLOCK_N=bn, BLOCK_K=bk, NORM=norm, GATED=gated, ADD=add, PDL=False)
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
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def reports() -> dict[tuple, str]:
    variants = [*launched_variants(), SPILLING]
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
    kinds = {(norm != 0, gated, add, m1) for *_, norm, gated, add, m1 in launched_variants()}
    for m1 in (True, False):
        assert {
            (True, False, False, m1),
            (True, True, False, m1),
            (False, False, True, m1),
        } <= kinds


@pytest.mark.parametrize("variant", launched_variants(), ids=str)
def test_each_launched_variant_compiles_for_sm90_without_spills(reports, variant):
    assert spill_stores(reports[variant]) == 0, reports[variant]


def test_the_loop_form_at_512_long_k_tiles_spills(reports):
    """What `fused_config` avoids, and the proof that the check reads a spill. If a newer
    Triton stops spilling here, the 512-long tiles can be measured again."""
    assert spill_stores(reports[SPILLING]) > 0, reports[SPILLING]


if __name__ == "__main__":  # (the fixture's child: variants in, reports out, as JSON)
    print(json.dumps([[v, compile_report(*v)] for v in json.loads(sys.argv[1])]))
