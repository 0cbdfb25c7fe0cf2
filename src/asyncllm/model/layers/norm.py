"""RMSNorm, with the residual add fused in when a residual is passed.

On CUDA one Triton kernel does the add, the norm and the scaling; elsewhere the
kernel's plain-torch reference does the same. Either way the residual is updated in
place to x + residual.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncllm_kernels.reference import rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`, the second
        being `residual` itself, updated in place."""
        if x.is_cuda:
            from asyncllm_kernels.elementwise import rms_norm

            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if residual is None:
                return rms_norm(x2, self.weight, self.eps).view(shape)
            if not residual.is_contiguous():
                residual = residual.contiguous()
            out = rms_norm(x2, self.weight, self.eps, residual.view(-1, shape[-1]))
            return out.view(shape), residual
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps, residual), residual
