"""Benchmarks of the whole engine, run as modules:

    python -m asyncllm.bench.throughput   # offline: one LLM.generate over 256 random prompts
    python -m asyncllm.bench.latency      # batch 1: 128-token prompt, 512 greedy tokens
    python -m asyncllm.bench.serving      # AsyncLLM under Poisson arrivals: TTFT, TPOT

Each prints a table and then one JSON line (the last line of stdout) with every figure,
and each `main(argv)` returns that JSON object. Prompts are token ids, so a folder with
only a config.json serves with `--load-format dummy --skip-tokenizer-init`
(`benchmarks/configs/` has the shapes of Qwen3-0.6B and Llama-3.1-8B).
"""
