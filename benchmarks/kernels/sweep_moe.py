"""The mixture-of-experts layers' two grouped GEMMs (`asyncllm_kernels.fused_moe`) of
Qwen3-30B-A3B and DeepSeek-V2-Lite at decode sizes (1-256 tokens), bf16: the default
tiles against tile sizes along N and K, warps and stages, each timed by CUDA-graph replay
over several routings (so that most experts' weights come from device memory, not L2).
Prints, per shape, token count and GEMM, the floor (the routed experts' weight bytes at
COPY_BW), the default's time and the best config's, and the whole layer (`fused_moe`:
sort, both GEMMs, the sum).

With --small, the small-batch path instead (`fused_moe_small`: no sort, two launches) at
1-8 tokens: the layer both ways, and from the router's logits (the routing kernel then
the small path, against `fused_moe_routed`, which routes inside the gate/up GEMM), then
each of its GEMMs under every config.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/sweep_moe.py [--quick | --small]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from triton.runtime.errors import OutOfResources

from asyncllm_kernels.fused_moe import (
    GroupedConfig,
    align_slots_by_expert,
    block_m_for,
    fused_moe,
    fused_moe_routed,
    fused_moe_small,
    fused_moe_sorted,
    grouped_gemm,
    small_down,
    small_gate_up,
    softmax_topk,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import COPY_BW, graph_time_calls_us, write_json  # noqa: E402

# (name, experts, top_k, hidden, expert intermediate size)
SHAPES = [("qwen30b", 128, 8, 2048, 768), ("dsv2lite", 64, 6, 2048, 1408)]
TOKENS = (1, 8, 64, 256)
ROUTINGS = 8


class Inputs(NamedTuple):
    """One routing's inputs, and the two GEMMs' outputs (`a` is the second's input)."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    a: torch.Tensor
    y: torch.Tensor


def configs(quick: bool) -> list[GroupedConfig]:
    if quick:
        return [GroupedConfig(32, 128, 4, 3), GroupedConfig(64, 64, 4, 3)]
    return [
        GroupedConfig(bn, bk, w, st)
        for bn, bk, w, st in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4))
        if bn * bk <= 8192
    ]


def sweep(name: str, E: int, K: int, H: int, inter: int, T: int, quick: bool) -> dict:
    """One shape at T tokens: the layer, then each GEMM under the default and every config."""
    dev = torch.device("cuda")
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) / inter**0.5
    block_m = block_m_for(T, K, E)
    sets = []
    for _ in range(ROUTINGS):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        weights, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), K, dim=-1)
        a = torch.empty(T * K, inter, device=dev, dtype=torch.bfloat16)
        y = torch.empty(T * K, H, device=dev, dtype=torch.bfloat16)
        sets.append(Inputs(x, weights, ids, align_slots_by_expert(ids, E, block_m), a, y))
    routed = sum(len(set(s.ids.flatten().tolist())) for s in sets) / ROUTINGS
    floor = routed * 3 * inter * H * 2 / COPY_BW * 1e6
    layer = graph_time_calls_us(
        [lambda s=s: fused_moe(s.x, w13, w2, s.weights, s.ids) for s in sets]
    )
    print(
        f"{name} T={T:3d}: {routed:5.1f} experts routed, floor {floor:6.1f} us, "
        f"the layer {layer:6.1f} us ({floor / layer:4.2f})",
        flush=True,
    )
    row: dict = dict(shape=name, tokens=T, experts_routed=routed, floor_us=floor, layer_us=layer)

    def gate_up(s: Inputs, cfg: GroupedConfig | None) -> torch.Tensor:
        grouped_gemm(s.x, w13, s.a, s.routing, None, K, block_m, True, cfg)
        return s.a

    def down(s: Inputs, cfg: GroupedConfig | None) -> torch.Tensor:
        grouped_gemm(s.a, w2, s.y, s.routing, s.weights.flatten(), 1, block_m, False, cfg)
        return s.y

    for gemm, call, share in (("gate_up", gate_up, 2 / 3), ("down", down, 1 / 3)):
        default = graph_time_calls_us([lambda s=s, f=call: f(s, None) for s in sets])
        want = call(sets[0], None).float().clone()
        timed: dict[GroupedConfig, float] = {}
        for cfg in configs(quick):
            try:
                got = call(sets[0], cfg).float()
            except OutOfResources:
                continue
            err = ((got - want).norm() / want.norm()).item()
            if err > 1e-2:
                raise AssertionError(f"{name} T={T} {gemm} {cfg}: relative error {err}")
            timed[cfg] = graph_time_calls_us([lambda s=s, c=cfg, f=call: f(s, c) for s in sets])
        best = min(timed, key=timed.__getitem__)
        print(
            f"  {gemm:8s} floor {floor * share:6.1f} us | default {default:6.1f} us "
            f"({floor * share / default:4.2f}) | best {timed[best]:6.1f} us "
            f"({floor * share / timed[best]:4.2f}) {best}",
            flush=True,
        )
        row[gemm] = dict(default_us=default, configs={str(c): t for c, t in timed.items()})
    return row


SMALL_TOKENS = (1, 2, 4, 8)


def small_candidates(gemm: str, tokens: int) -> list[GroupedConfig]:
    """The tiles tried for one of the small path's GEMMs at `tokens` tokens; the one-row
    forms (fewer than 16 rows a program: no tl.dot, no software pipeline, so their stages
    do not matter) at one token only, those without spills and at most about 180
    registers on sm_90a."""
    if gemm == "down":  # (deeper pipelines too: 8 stages won at two tokens)
        dot = [
            GroupedConfig(bn, bk, 4, st)
            for bn, bk, st in itertools.product((16, 32), (256, 512), (4, 5, 6, 8))
        ]
        rows = [(1, 256, 2), (1, 512, 4), (2, 128, 4), (2, 256, 4), (2, 256, 8), (2, 512, 8)]
        rows += [(4, 128, 4), (4, 256, 4), (4, 256, 8), (4, 512, 8), (8, 128, 4), (8, 256, 8)]
    else:
        dot = [
            GroupedConfig(bn, bk, 4, st)
            for bn, bk, st in itertools.product((16, 32), (128, 256, 512), (3, 4, 5))
        ]
        rows = [(1, 1024, 4), (1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4)]
        rows += [(4, 1024, 8), (8, 512, 8)]
    return dot + ([GroupedConfig(bn, bk, w, 1) for bn, bk, w in rows] if tokens == 1 else [])


def sweep_small(name: str, E: int, K: int, H: int, inter: int, T: int) -> dict:
    """The small-batch path at T tokens: the layer against the sorted path, then each of
    its GEMMs under the default tiles and every config."""
    dev = torch.device("cuda")
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) / inter**0.5
    sets = []
    for _ in range(ROUTINGS):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        weights, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), K, dim=-1)
        sets.append((x, weights, ids, ids.flatten().contiguous(), weights.flatten().contiguous()))
    routed = sum(len(set(s[2].flatten().tolist())) for s in sets) / ROUTINGS
    floor = routed * 3 * inter * H * 2 / COPY_BW * 1e6
    want = fused_moe_sorted(sets[0][0], w13, w2, sets[0][1], sets[0][2])
    got = fused_moe_small(sets[0][0], w13, w2, sets[0][1], sets[0][2]).float()
    err = ((got - want.float()).norm() / want.float().norm()).item()
    if err > 1e-2:
        raise AssertionError(f"{name} T={T}: the small path's relative error {err}")
    layer = {
        path: graph_time_calls_us([lambda s=s, f=f: f(s[0], w13, w2, s[1], s[2]) for s in sets])
        for path, f in (("sorted", fused_moe_sorted), ("small", fused_moe_small))
    }
    logits = [torch.randn(T, E, device=dev, dtype=torch.bfloat16) for _ in sets]

    def route_then_small(i: int) -> torch.Tensor:
        weights, ids = softmax_topk(logits[i], K, True, round_to=torch.bfloat16)
        return fused_moe_small(sets[i][0], w13, w2, weights, ids)

    def routed_inside(i: int, by_rank: bool = True) -> torch.Tensor:
        return fused_moe_routed(
            sets[i][0], w13, w2, logits[i], K, True, round_to=torch.bfloat16, by_rank=by_rank
        )

    def routed_by_loop(i: int) -> torch.Tensor:
        return routed_inside(i, by_rank=False)

    routed_paths = ("routing+small", "routed", "routed-loop")
    if T <= 4:
        for path, f in zip(routed_paths, (route_then_small, routed_inside, routed_by_loop)):
            layer[path] = graph_time_calls_us([lambda i=i, f=f: f(i) for i in range(ROUTINGS)])
    print(
        f"{name} T={T}: {routed:5.1f} experts routed, floor {floor:6.1f} us, the layer "
        f"sorted {layer['sorted']:6.1f} us ({floor / layer['sorted']:4.2f}), "
        f"small {layer['small']:6.1f} us ({floor / layer['small']:4.2f})"
        + "".join(f", {p} {layer[p]:6.1f} us" for p in routed_paths if p in layer),
        flush=True,
    )
    row: dict = dict(shape=name, tokens=T, experts_routed=routed, floor_us=floor, layer_us=layer)
    if T > 4:
        return row
    a_sets = [small_gate_up(s[0], w13, s[3], s[4]) for s in sets]

    def gate_up(i: int, cfg: GroupedConfig | None) -> torch.Tensor:
        return small_gate_up(sets[i][0], w13, sets[i][3], sets[i][4], cfg)

    def down(i: int, cfg: GroupedConfig | None) -> torch.Tensor:
        return small_down(a_sets[i], w2, sets[i][3], T, cfg)

    for gemm, call, share in (("gate_up", gate_up, 2 / 3), ("down", down, 1 / 3)):
        default = graph_time_calls_us([lambda i=i, f=call: f(i, None) for i in range(ROUTINGS)])
        ref = call(0, None).float()
        timed: dict[GroupedConfig, float] = {}
        for cfg in small_candidates(gemm, T):
            try:
                out = call(0, cfg).float()
            except OutOfResources:
                continue
            err = ((out - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise AssertionError(f"{name} T={T} {gemm} {cfg}: relative error {err}")
            timed[cfg] = graph_time_calls_us(
                [lambda i=i, c=cfg, f=call: f(i, c) for i in range(ROUTINGS)]
            )
        best = sorted(timed, key=timed.__getitem__)
        print(
            f"  {gemm:8s} floor {floor * share:6.1f} us | default {default:6.1f} us "
            f"({floor * share / default:4.2f}) | best {timed[best[0]]:6.1f} us "
            f"({floor * share / timed[best[0]]:4.2f}) {best[0]}",
            flush=True,
        )
        for cfg in best[1:4]:
            print(f"    next {timed[cfg]:6.1f} us {cfg}", flush=True)
        row[gemm] = dict(default_us=default, configs={str(c): t for c, t in timed.items()})
    return row


def main() -> None:
    quick = "--quick" in sys.argv
    if "--small" in sys.argv:
        torch.manual_seed(0)
        rows = [
            sweep_small(name, E, K, H, inter, T)
            for name, E, K, H, inter in SHAPES
            for T in SMALL_TOKENS
        ]
        write_json("sweep_moe_small", rows)
        return
    torch.manual_seed(0)
    rows = []
    for name, E, K, H, inter in SHAPES:
        for T in TOKENS:
            rows.append(sweep(name, E, K, H, inter, T, quick))
            torch.cuda.empty_cache()
    write_json("sweep_moe", rows)


if __name__ == "__main__":
    main()
