"""RMSNorm, computed in float32 as transformers does.

On CUDA one Triton kernel (kernels/rms_norm.py) does the residual add and the norm in one
launch, rounding where the torch code below rounds; elsewhere the torch code runs.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm op by op: float32 statistics, rounded to x's dtype, times weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from batchgen.kernels.rms_norm import rms_norm

            out = rms_norm(as_rows(x), self.weight, self.eps)
            return out.view(*x.shape[:-1], out.shape[-1])
        return rms_norm_torch(x, self.weight, self.eps)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the residual (if any), normalise; returns (normalised, new residual).
        Neither input is written."""
        if residual is None:
            return self.forward(x), x
        if x.is_cuda and residual.dtype == x.dtype:
            from batchgen.kernels.rms_norm import rms_norm

            out, new_residual = rms_norm(as_rows(x), self.weight, self.eps, as_rows(residual))
            return out.view(*x.shape[:-1], out.shape[-1]), new_residual.view(x.shape)
        x = x + residual
        return self.forward(x), x


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim], contiguous within a row (a view when x already is)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
