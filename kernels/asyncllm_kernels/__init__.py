"""Triton kernels for asyncllm, each with a plain-torch reference beside it.

elementwise.py  reshape_and_cache (KV cache write), rms_norm (fused residual), silu_and_mul
rotary.py       rotary embedding on q and k in place (NeoX and GPT-J layouts)

Tests run them under Triton's interpreter on the CPU (tests/kernels) and natively on a GPU.
"""
