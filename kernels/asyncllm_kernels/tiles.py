"""Tiles measured on one card, ahead of the built-in tables: the skinny GEMM's `TUNED`
(per weight shape and M) and the MoE small path's `SMALL_TUNED` (per token count and
layer shape).

The built-in tables hold what sweeps measured on an H100 or H200 and what main has
timed end to end. A tiles file carries another card's (or a candidate's) choices so that
an engine can run them without an edit: `pick` makes one from the JSON rows that
`benchmarks/kernels/sweep_skinny_gemm.py` and `sweep_moe.py --small` write, `load`
applies one (the engine does so at start-up from `ASYNCLLM_TILES`). The file:

    {"skinny": [{"n": 2048, "k": 4096, "configs": [[1, [2, 2048, 4, 1]], [16, [16, 256, 4, 4]]]}],
     "moe_small": [{"tokens": 1, "hidden": 2048, "inter": 768,
                    "gate_up": [32, 128, 4, 4], "down": [4, 256, 4, 1]}]}

A tile is [rows a program (block_n), block_k, warps, stages]. A skinny entry lists
(largest M, tile) in increasing M, as `TUNED` does, a tile of null meaning cuBLAS for
that range; an empty list means cuBLAS for every M of that shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import astuple
from pathlib import Path
from typing import Any

from asyncllm_kernels import fused_moe, skinny_gemm
from asyncllm_kernels.fused_moe import GroupedConfig
from asyncllm_kernels.skinny_gemm import MAX_M, SkinnyConfig

# A sweep's winner replaces the tile in use only when it is this much faster (timing
# noise between configs of one sweep is about 1%).
MARGIN = 0.02


def _tile(value: Any, where: str) -> tuple[int, int, int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 4
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(
            f"{where} must be [block_n, block_k, warps, stages] of positive ints, got {value!r}"
        )
    bn, bk, warps, stages = value
    for name, v in (("block_k", bk), ("warps", warps)):
        if v & (v - 1):
            raise ValueError(f"{where}: {name} must be a power of two, got {v}")
    return bn, bk, warps, stages


def _int(entry: dict, key: str, where: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}.{key} must be a positive int, got {value!r}")
    return value


def parse(data: Any) -> tuple[dict, dict]:
    """(skinny entries, MoE entries) of a tiles file's content, checked: a ValueError
    naming the field that is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"a tiles file holds a JSON object, got {type(data).__name__}")
    unknown = set(data) - {"skinny", "moe_small", "device", "source"}
    if unknown:
        raise ValueError(f"a tiles file has no field {sorted(unknown)[0]!r}")
    skinny: dict[tuple[int, int], tuple[tuple[int, SkinnyConfig | None], ...]] = {}
    for i, entry in enumerate(data.get("skinny", [])):
        where = f"skinny[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        n, k = _int(entry, "n", where), _int(entry, "k", where)
        configs = entry.get("configs")
        if not isinstance(configs, list):
            raise ValueError(f"{where}.configs must be a list of [largest M, tile]")
        rows: list[tuple[int, SkinnyConfig | None]] = []
        for j, item in enumerate(configs):
            at = f"{where}.configs[{j}]"
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int):
                raise ValueError(f"{at} must be [largest M, tile or null], got {item!r}")
            largest = item[0]
            tile = None if item[1] is None else SkinnyConfig(*_tile(item[1], f"{at}[1]"))
            if not 1 <= largest <= MAX_M or (rows and largest <= rows[-1][0]):
                raise ValueError(f"{at}: largest M must rise within 1..{MAX_M}, got {largest}")
            if tile is not None and tile.block_n < 16 and largest > 1:
                raise ValueError(f"{at}: a tile of fewer than 16 rows serves M = 1 only")
            rows.append((largest, tile))
        skinny[(n, k)] = tuple(rows)
    moe: dict[tuple[int, int, int], tuple[GroupedConfig, GroupedConfig]] = {}
    for i, entry in enumerate(data.get("moe_small", [])):
        where = f"moe_small[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        tokens = _int(entry, "tokens", where)
        if tokens > fused_moe.SMALL_BATCH_TOKENS:
            raise ValueError(
                f"{where}.tokens: the small path serves up to "
                f"{fused_moe.SMALL_BATCH_TOKENS} tokens, got {tokens}"
            )
        key = (tokens, _int(entry, "hidden", where), _int(entry, "inter", where))
        gate_up = GroupedConfig(*_tile(entry.get("gate_up"), f"{where}.gate_up"))
        down = GroupedConfig(*_tile(entry.get("down"), f"{where}.down"))
        moe[key] = (gate_up, down)
    return skinny, moe


def apply(data: Any) -> None:
    """Puts a tiles file's content (checked by `parse`) ahead of the built-in tables."""
    skinny, moe = parse(data)
    skinny_gemm.TUNED.update(skinny)
    fused_moe.SMALL_TUNED.update(moe)


def load(path: str | Path) -> dict:
    """Applies the tiles file at `path`; returns its content."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the tiles file {str(path)!r}: {e}") from e
    try:
        apply(data)
    except ValueError as e:
        raise ValueError(f"tiles file {str(path)!r}: {e}") from e
    return data


def _config_of(text: str) -> list[int]:
    """[block_n, block_k, warps, stages] of a config's repr (the sweeps' JSON keys)."""
    fields = dict(re.findall(r"(\w+)=(\d+)", text))
    return [int(fields[f]) for f in ("block_n", "block_k", "num_warps", "num_stages")]


def pick_moe(rows: Iterable[dict], shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """The small path's entries from `sweep_moe.py --small` rows: per shape (name ->
    (hidden, inter)) and token count, each GEMM's fastest tile where it beats the tile in
    use by MARGIN (else the tile in use); shapes and counts where neither GEMM changes
    are left out."""
    picked = []
    for row in rows:
        if "gate_up" not in row or row["shape"] not in shapes:
            continue
        hidden, inter = shapes[row["shape"]]
        tokens = row["tokens"]
        in_use = [list(astuple(c)) for c in fused_moe.small_configs(tokens, hidden, inter)]
        chosen = []
        for gemm, current in zip(("gate_up", "down"), in_use, strict=True):
            timed = row[gemm]["configs"]
            best = min(timed, key=timed.__getitem__)
            faster = timed[best] < row[gemm]["default_us"] * (1 - MARGIN)
            chosen.append(_config_of(best) if faster else current)
        if chosen != in_use:
            picked.append(
                dict(tokens=tokens, hidden=hidden, inter=inter, gate_up=chosen[0], down=chosen[1])
            )
    return picked


def pick_skinny(rows: Iterable[dict]) -> list[dict]:
    """The skinny GEMM's entries from `sweep_skinny_gemm.py` rows (n, k, the M values,
    cuBLAS's time at each, each config's at the Ms it ran): at M = 1 the fastest tile if
    it beats cuBLAS by MARGIN, else cuBLAS (null); above, up to the largest M swept, the
    tile that beats cuBLAS by MARGIN at every M from 2 up to the furthest M (the one
    reaching furthest, then the first), then cuBLAS; past the largest M swept, the
    built-in entries. Nothing but cuBLAS: an empty list."""
    picked = []
    for row in rows:
        ms, cublas = row["ms"], dict(zip(row["ms"], row["cublas_us"], strict=True))
        times = {cfg: {int(m): t for m, t in by_m.items()} for cfg, by_m in row["times"].items()}
        configs: list[list] = []
        at_one = {cfg: t[1] for cfg, t in times.items() if 1 in t}
        best = min(at_one, key=at_one.__getitem__) if at_one else None
        faster = best is not None and at_one[best] < cublas[1] * (1 - MARGIN)
        configs.append([1, _config_of(best) if faster and best else None])
        above = [m for m in ms if m > 1]
        best_reach, best_cfg = 0, None
        for cfg, t in times.items():
            reach = 0
            for m in above:
                if m not in t or t[m] >= cublas[m] * (1 - MARGIN):
                    break
                reach = m
            if reach > best_reach:
                best_reach, best_cfg = reach, cfg
        if best_cfg is not None:
            configs.append([best_reach, _config_of(best_cfg)])
        swept = max(ms)
        if swept > configs[-1][0]:
            configs.append([swept, None])
        for largest, tile in skinny_gemm.TUNED.get((row["n"], row["k"]), ()):
            if largest > swept:
                configs.append([largest, list(astuple(tile)) if tile is not None else None])
        if all(tile is None for _, tile in configs):
            configs = []
        picked.append(dict(n=row["n"], k=row["k"], configs=configs))
    return picked
