"""The Triton backend's start-up warm-up of mixed (prefill + decode) steps, on the CPU:
one batch per launch config, short chunks and long, each inert (the KV cache is
untouched)."""

from __future__ import annotations

import torch

from asyncllm.model.attention.triton_attn import TritonAttentionBackend, mixed_warm_up_sizes
from asyncllm_kernels.paged_attention import SHORT_QUERY, choose_config
from tests.model.tiny import make_tiny_model, tiny_engine_core


def test_one_inert_mixed_batch_per_decode_launch_config(tmp_path):
    make_tiny_model("llama3", tmp_path)
    core = tiny_engine_core(tmp_path, max_num_seqs=64)
    try:
        worker = core.executor.worker
        runner, startup = worker.runner, worker.startup
        ctx = startup.warm_up_context()
        sizes = mixed_warm_up_sizes(ctx)
        spec = runner.model.kv_cache_spec()
        hf = runner.config.model.hf_config
        group = hf.num_attention_heads // hf.num_key_value_heads
        assert (ctx.num_kv_heads, ctx.head_size, ctx.group) == (
            spec.num_kv_heads,
            spec.head_size,
            group,
        )

        def config(n: int, chunk: int):
            return choose_config(
                n, spec.num_kv_heads, group, spec.head_size, True, runner.device,
                query_len=2 if chunk <= SHORT_QUERY else 1,
            )  # fmt: skip

        # A short chunk (one launch of short tiles) beside 0 to 63 decodes, and a long
        # one (two launches: the decodes' config varies with the batch) beside 1 to 63.
        every = {(config(n, 2), 2) for n in range(1, 65)}
        every |= {(config(n, SHORT_QUERY + 1), SHORT_QUERY + 1) for n in range(2, 65)}
        assert len(sizes) == len(every) > 2  # (the interpreter's small "GPU" splits too)
        assert {(config(n, c), c) for n, c in sizes} == every
        before = [c.clone() for c in runner.kv_caches]
        for n, c in sizes:
            startup.run_inert_mixed_batch(n, c)
        assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
        assert startup.warm_up_attention() == 0  # the torch backend: nothing to compile
        # on the CPU the Triton backend compiles nothing either (the interpreter)
        assert TritonAttentionBackend().warm_up(ctx) == 0
    finally:
        core.shutdown()
