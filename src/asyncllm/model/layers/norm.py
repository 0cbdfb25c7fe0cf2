"""RMSNorm, with the residual add fused in when a residual is passed.

On CUDA one Triton kernel does the add, the norm and the scaling; elsewhere the
kernel's plain-torch reference does the same. Either way the residual is updated in
place to x + residual.

A decoder layer hands its norms to the linear layers after them as a `PendingNorm`:
where the norm's weight is folded into the linear layer's (`fold_into`), a small
batch's GEMM launch on CUDA normalizes its own input (layers/linear.py); otherwise
`resolve()` runs the norm as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncllm_kernels.reference import rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.folded = False

    @torch.no_grad()
    def fold_into(self, linear: nn.Module) -> None:
        """Moves this norm's weight g into the input columns of the linear layer it feeds
        (w * g, rounded once), leaving itself a weight of ones: norm(x) @ w.T is
        unchanged, and a small batch's GEMM can then scale x's rows on its own, x
        entering the dot as loaded (layers/linear.py)."""
        g, weight = self.weight.float(), linear.weight
        assert isinstance(weight, torch.Tensor)
        for rows in weight.split(4096):  # (float32 a slice at a time)
            rows.copy_((rows.float() * g).to(rows.dtype))
        self.weight.fill_(1.0)
        self.folded = True

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


@dataclass
class PendingNorm:
    """`norm(x + residual)` (`norm(residual)` where x is None), left to the one linear
    layer that consumes it. Either way of computing it leaves x + residual in the
    residual, in place, as RMSNorm does: the residual stream (and x None, so that a
    second use adds nothing twice)."""

    norm: RMSNorm
    x: torch.Tensor | None
    residual: torch.Tensor

    @staticmethod
    def of(norm: RMSNorm, x: torch.Tensor | None, residual: torch.Tensor | None) -> PendingNorm:
        """A decoder layer's input norm: the first layer's residual is its input (nothing
        to add); a later one's x is what the layer before left to add (None: nothing)."""
        if residual is None:
            assert x is not None  # (the first layer's input)
            return PendingNorm(norm, None, x)
        return PendingNorm(norm, x, residual)

    def resolve(self) -> torch.Tensor:
        """The normalized tensor (the norm's own launch, the add fused in)."""
        if self.x is None:
            return self.norm(self.residual)
        out, _ = self.norm(self.x, self.residual)
        self.x = None
        return out

    def stream(self) -> torch.Tensor:
        """The residual with x added (in place, where x is pending): what a kernel that
        normalizes its own input reads."""
        if self.x is not None:
            self.residual.add_(self.x)
            self.x = None
        return self.residual
