"""A tiles file from the sweeps' JSON in a folder: sweep_skinny_gemm*.json and
`sweep_moe_small.json` (written under $OUT by `sweep_skinny_gemm.py` and
`sweep_moe.py --small`), whichever are there, into FOLDER/tiles.json, which an engine
runs with `ASYNCLLM_TILES=FOLDER/tiles.json` (`asyncllm_kernels.tiles`; h200.sh's
`tiles-from-sweeps` stage and `-tiles` suffix). Prints the file.

    PYTHONPATH=src:kernels python3 benchmarks/kernels/pick_tiles.py FOLDER
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncllm_kernels.tiles import parse, pick_moe, pick_skinny

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_moe import SHAPES  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    folder = Path(sys.argv[1])
    tiles: dict = {"source": []}
    found = {p.stem: json.loads(p.read_text()) for p in folder.glob("sweep_*.json")}
    skinny = sorted(name for name in found if name.startswith("sweep_skinny_gemm"))
    if skinny:
        tiles["skinny"] = pick_skinny([row for name in skinny for row in found[name]["rows"]])
        tiles["source"] += [f"{name}.json" for name in skinny]
    if "sweep_moe_small" in found:
        shapes = {name: (hidden, inter) for name, _, _, hidden, inter in SHAPES}
        tiles["moe_small"] = pick_moe(found["sweep_moe_small"]["rows"], shapes)
        tiles["source"].append("sweep_moe_small.json")
    if not tiles["source"]:
        raise SystemExit(f"no sweep_skinny_gemm*.json or sweep_moe_small.json in {folder}")
    parse(tiles)  # (what an engine would refuse is refused here)
    text = json.dumps(tiles, indent=1)
    (folder / "tiles.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
