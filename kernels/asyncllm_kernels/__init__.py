"""Triton kernels for asyncllm, each with a plain-torch reference beside it."""
