"""The KV memory the hybrid KV cache saves on a model with windowed layers: the engine
started twice on the same KV cache bytes, windowed layers in groups of their own
(the default) and every layer keeping every token (--disable-hybrid-kv-cache-manager);
reported: blocks, bytes per block and how many requests of max_model_len fit.

    python benchmarks/hybrid_kv.py --model benchmarks/configs/gemma-3-1b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --kv-cache-memory-bytes 8e9
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from asyncllm.bench.common import add_engine_args, engine_kwargs
from asyncllm.entrypoints.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    args = parser.parse_args()
    kw = engine_kwargs(args)
    kw.pop("disable_hybrid_kv_cache_manager", None)
    rows = {}
    for name, off in (("hybrid", False), ("every layer global", True)):
        with LLM(**kw, multiprocess=False, disable_hybrid_kv_cache_manager=off) as llm:
            report = dataclasses.asdict(llm.engine.client.core.executor.worker.report)
            groups = len(llm.engine.client.core.kv_cache_manager.coordinator.groups)
        rows[name] = {
            "groups": groups,
            "num_blocks": report["num_blocks"],
            "block_bytes": report["kv_cache_bytes"] // report["num_blocks"],
            "kv_cache_gib": report["kv_cache_bytes"] / 2**30,
            "max_concurrency": report["max_concurrency"],
        }
        print(name, rows[name], flush=True)
    ratio = rows["hybrid"]["max_concurrency"] / rows["every layer global"]["max_concurrency"]
    print(f"requests of max_model_len that fit: {ratio:.2f}x with the hybrid KV cache")
    print(json.dumps({"benchmark": "hybrid_kv", "rows": rows, "ratio": ratio}))


if __name__ == "__main__":
    main()
