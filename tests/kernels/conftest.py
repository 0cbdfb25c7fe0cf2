"""Kernel tests run under Triton's interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any kernel module is imported (the `triton.jit`
decorator reads it), so it is set here, before the test modules load.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
