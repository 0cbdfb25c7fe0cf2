"""Triton kernels for asyncllm, each with a plain-torch reference.

elementwise.py      reshape_and_cache (KV cache write), rms_norm (fused residual), silu_and_mul
rotary.py           rotary embedding on q and k in place (NeoX and GPT-J layouts)
paged_attention.py  paged attention over a flat batch of prefill chunks and decodes
bitmask.py          apply_token_bitmask_ (grammar masks on the logits, one launch)
pdl.py              programmatic dependent launch for these kernels (sm_90+, opt-in)
tiles.py            a card's measured tiles (a JSON file) ahead of the built-in tables
reference.py        the plain-torch reference of each (`*_ref`): imports torch only, not Triton
stream_ops.py       the device waits for / writes a 32-bit flag in host memory (the CUDA
                    driver's stream memory operations, through ctypes; no Triton)

Tests run the kernels under Triton's interpreter on the CPU (tests/kernels) and natively
on a GPU. This package never imports asyncllm; asyncllm's layers import it.
"""
