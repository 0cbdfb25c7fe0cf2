"""RMSNorm, with the residual add fused in when a residual is passed.

On CUDA one Triton kernel does the add, the norm and the scaling (the residual is
updated in place); elsewhere plain torch.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before scaling, like the reference models.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`."""
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
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
