"""Tiles files (asyncllm_kernels/tiles.py): applied ahead of the built-in tables, checked
field by field, and picked from the sweeps' JSON rows (benchmarks/kernels/pick_tiles.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncllm_kernels import fused_moe, skinny_gemm, tiles
from asyncllm_kernels.fused_moe import GroupedConfig, small_configs
from asyncllm_kernels.skinny_gemm import SkinnyConfig, skinny_config

ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def built_in_tables():
    """Each test starts from, and leaves, the built-in tables."""
    tuned, small = dict(skinny_gemm.TUNED), dict(fused_moe.SMALL_TUNED)
    yield
    skinny_gemm.TUNED.clear()
    skinny_gemm.TUNED.update(tuned)
    fused_moe.SMALL_TUNED.clear()
    fused_moe.SMALL_TUNED.update(small)


def test_a_tiles_file_goes_ahead_of_the_built_in_tables(tmp_path):
    assert skinny_config(1, 2048, 4096, BF16) is not None  # (a built-in entry)
    default_moe = small_configs(1, 2048, 768)
    path = tmp_path / "tiles.json"
    path.write_text(
        json.dumps(
            {
                "skinny": [
                    {"n": 96, "k": 64, "configs": [[1, [4, 64, 4, 1]], [8, [16, 32, 4, 3]]]},
                    {"n": 2048, "k": 4096, "configs": []},
                ],
                "moe_small": [
                    {"tokens": 1, "hidden": 2048, "inter": 768, "gate_up": [2, 1024, 4, 1],
                     "down": [4, 256, 4, 1]},
                ],
            }
        )
    )  # fmt: skip
    tiles.load(path)
    assert skinny_config(1, 96, 64, BF16) == SkinnyConfig(4, 64, 4, 1)
    assert skinny_config(8, 96, 64, BF16) == SkinnyConfig(16, 32, 4, 3)
    assert skinny_config(9, 96, 64, BF16) is None
    assert skinny_config(1, 2048, 4096, BF16) is None  # (an empty list: cuBLAS)
    assert small_configs(1, 2048, 768) == (
        GroupedConfig(2, 1024, 4, 1),
        GroupedConfig(4, 256, 4, 1),
    )
    assert small_configs(1, 2048, 1408) == default_moe  # (another shape keeps the default)
    assert small_configs(1) == default_moe


def _moe_entry(**fields) -> dict:
    """A tiles file of one MoE entry, its fields as given over valid ones."""
    entry = dict(tokens=1, hidden=8, inter=8, gate_up=[16, 32, 4, 1], down=[16, 32, 4, 1])
    return {"moe_small": [{**entry, **fields}]}


@pytest.mark.parametrize(
    "content,message",
    [
        ([], "a tiles file holds a JSON object, got list"),
        ({"skinnny": []}, "a tiles file has no field 'skinnny'"),
        ({"skinny": [{"n": 8, "configs": []}]}, r"skinny\[0\]\.k must be a positive int"),
        (
            {"skinny": [{"n": 8, "k": 8, "configs": [[1, [16, 32, 4]]]}]},
            r"skinny\[0\]\.configs\[0\]\[1\] must be \[block_n, block_k, warps, stages\]",
        ),
        (
            {"skinny": [{"n": 8, "k": 8, "configs": [[4, [4, 32, 4, 1]]]}]},
            r"skinny\[0\]\.configs\[0\]: a tile of fewer than 16 rows serves M = 1 only",
        ),
        (
            {"skinny": [{"n": 8, "k": 8, "configs": [[4, [16, 32, 4, 1]], [2, [16, 32, 4, 1]]]}]},
            r"skinny\[0\]\.configs\[1\]: largest M must rise within 1\.\.16, got 2",
        ),
        (
            _moe_entry(gate_up=[16, 48, 4, 1]),
            r"moe_small\[0\]\.gate_up: block_k must be a power of two, got 48",
        ),
        (
            _moe_entry(tokens=5),
            r"moe_small\[0\]\.tokens: the small path serves up to 4 tokens, got 5",
        ),
    ],
)
def test_a_wrong_field_is_named_and_nothing_is_applied(tmp_path, content, message):
    before = dict(skinny_gemm.TUNED)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        tiles.load(path)
    assert skinny_gemm.TUNED == before


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read the tiles file .*nothing.json"):
        tiles.load(tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read the tiles file .*bad.json"):
        tiles.load(tmp_path / "bad.json")


def _moe_row(shape, tokens, gate_up, down):
    """A `sweep_moe.py --small` row: each GEMM's default time and its configs' times."""

    def gemm(default, timed):
        return {"default_us": default, "configs": {repr(c): t for c, t in timed.items()}}

    return {"shape": shape, "tokens": tokens, "gate_up": gemm(*gate_up), "down": gemm(*down)}


def test_the_moe_pick_takes_a_winner_only_past_the_margin():
    one_row, dot = GroupedConfig(4, 256, 4, 1), GroupedConfig(32, 256, 4, 5)
    rows = [
        # down: 20 us by default, 12 with the one-row tile; gate/up: 1% faster, kept
        _moe_row("qwen30b", 1, (19.5, {dot: 19.3}), (20.0, {one_row: 12.0, dot: 21.0})),
        # nothing 2% faster: left out
        _moe_row("qwen30b", 2, (25.0, {dot: 24.8}), (19.0, {dot: 18.9})),
        _moe_row("unknown", 1, (25.0, {dot: 1.0}), (19.0, {dot: 1.0})),  # (no shape: skipped)
    ]
    picked = tiles.pick_moe(rows, {"qwen30b": (2048, 768)})
    gate_up_in_use = list(small_configs(1)[0].__dict__.values())
    assert picked == [
        dict(tokens=1, hidden=2048, inter=768, gate_up=gate_up_in_use, down=[4, 256, 4, 1])
    ]
    tiles.apply({"moe_small": picked})
    assert small_configs(1, 2048, 768)[1] == one_row


def test_the_skinny_pick_takes_m1_and_the_furthest_reaching_tile_above():
    one_row, wide, narrow = (
        SkinnyConfig(2, 2048, 4, 1),
        SkinnyConfig(32, 128, 4, 6),
        SkinnyConfig(16, 256, 4, 4),
    )
    row = {
        "n": 2048,
        "k": 4096,
        "ms": [1, 2, 4, 8],
        "cublas_us": [10.0, 10.0, 10.0, 10.0],
        "times": {
            repr(one_row): {"1": 7.0},
            repr(wide): {"1": 9.5, "2": 9.0, "4": 9.9, "8": 10.5},  # (beats it up to M = 2)
            repr(narrow): {"1": 9.9, "2": 9.5, "4": 9.5, "8": 9.9},  # (up to M = 4)
        },
    }
    slower = dict(row, n=4096, times={repr(wide): {"1": 9.9, "2": 9.9, "4": 10.0, "8": 11.0}})
    picked = tiles.pick_skinny([row, slower])
    built_in_above = [16, [16, 256, 4, 4]]  # (TUNED's entry past the M = 8 swept)
    assert picked == [
        dict(
            n=2048,
            k=4096,
            configs=[[1, [2, 2048, 4, 1]], [4, [16, 256, 4, 4]], [8, None], built_in_above],
        ),
        dict(n=4096, k=4096, configs=[[1, None], [8, None], [16, [32, 128, 4, 6]]]),
    ]
    tiles.apply({"skinny": picked})
    assert skinny_config(1, 2048, 4096, BF16) == one_row
    assert skinny_config(4, 2048, 4096, BF16) == narrow
    assert skinny_config(8, 2048, 4096, BF16) is None  # (cuBLAS: nothing beat it at 8)
    assert skinny_config(16, 2048, 4096, BF16) == SkinnyConfig(16, 256, 4, 4)
    assert skinny_config(1, 4096, 4096, BF16) is None
    assert tiles.pick_skinny([dict(slower, n=96)]) == [dict(n=96, k=4096, configs=[])]


def test_pick_tiles_writes_a_file_the_engine_accepts(tmp_path):
    """benchmarks/kernels/pick_tiles.py on a folder of sweep JSON (no GPU needed)."""
    row = _moe_row(
        "dsv2lite",
        1,
        (30.0, {GroupedConfig(2, 1024, 4, 1): 25.0}),
        (30.0, {GroupedConfig(16, 512, 4, 5): 29.9}),
    )
    (tmp_path / "sweep_moe_small.json").write_text(json.dumps({"meta": {}, "rows": [row]}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "kernels")])
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kernels/pick_tiles.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    written = json.loads((tmp_path / "tiles.json").read_text())
    assert written["moe_small"] == [
        dict(tokens=1, hidden=2048, inter=1408, gate_up=[2, 1024, 4, 1],
             down=list(small_configs(1)[1].__dict__.values()))
    ]  # fmt: skip
    tiles.load(tmp_path / "tiles.json")
    assert small_configs(1, 2048, 1408)[0] == GroupedConfig(2, 1024, 4, 1)


def test_a_sweep_of_m1_alone_keeps_the_built_in_tiles_above_it():
    """(`sweep_skinny_gemm.py --m1`): Llama-3.1-8B's o_proj keeps its M = 2-16 entry."""
    one_row = SkinnyConfig(2, 2048, 4, 1)
    above = dict(skinny_gemm.TUNED[(4096, 4096)])[16]
    row = {
        "n": 4096,
        "k": 4096,
        "ms": [1],
        "cublas_us": [13.5],
        "times": {repr(one_row): {"1": 9.0}},
    }
    picked = tiles.pick_skinny([row])
    assert picked == [
        dict(n=4096, k=4096, configs=[[1, [2, 2048, 4, 1]], [16, list(above.__dict__.values())]])
    ]
    tiles.apply({"skinny": picked})
    assert skinny_config(1, 4096, 4096, BF16) == one_row
    assert skinny_config(16, 4096, 4096, BF16) == above


def test_the_engine_applies_asyncllm_tiles_at_start_and_a_wrong_file_fails_it(
    tmp_path, monkeypatch
):
    """ASYNCLLM_TILES reaches the worker (on any device: the CPU engine here, in this
    process); a wrong field fails the start with EngineStartupError naming it."""
    from asyncllm import LLM, EngineStartupError, SamplingParams

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"moe_small": [{"tokens": 9}]}))
    monkeypatch.setenv("ASYNCLLM_TILES", str(bad))
    with pytest.raises(EngineStartupError, match=r"moe_small\[0\]\.tokens"):
        LLM(device="cpu", multiprocess=False, max_model_len=256)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"skinny": [{"n": 96, "k": 64, "configs": [[1, [4, 64, 4, 1]]]}]}))
    monkeypatch.setenv("ASYNCLLM_TILES", str(good))
    with LLM(device="cpu", multiprocess=False, max_model_len=256) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert skinny_config(1, 96, 64, BF16) == SkinnyConfig(4, 64, 4, 1)
