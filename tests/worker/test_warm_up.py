"""The start-up warm-up of mixed (prefill + decode) steps, on the CPU: one batch per
decode-launch config of the Triton backend, each inert (the KV cache is untouched)."""

from __future__ import annotations

import torch

from asyncllm_kernels.paged_attention import choose_config
from tests.model.tiny import make_tiny_model, tiny_engine_core


def test_one_inert_mixed_batch_per_decode_launch_config(tmp_path):
    make_tiny_model("llama3", tmp_path)
    core = tiny_engine_core(tmp_path, max_num_seqs=64)
    try:
        runner = core.executor.worker.runner
        sizes = runner.mixed_warm_up_sizes()
        spec = runner.model.kv_cache_spec()
        hf = runner.config.model.hf_config
        group = hf.num_attention_heads // hf.num_key_value_heads

        def config(n: int):
            return choose_config(n, spec.num_kv_heads, group, spec.head_size, True, runner.device)

        every = {config(n) for n in range(2, 65)}
        assert len(sizes) == len(every) > 1  # (the interpreter's small "GPU" splits too)
        assert {config(n) for n in sizes} == every
        before = [c.clone() for c in runner.kv_caches]
        for n in sizes:
            runner.run_inert_mixed_batch(n)
        assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
        assert runner.warm_up_mixed_steps() == 0  # on the CPU: nothing to compile
    finally:
        core.shutdown()
