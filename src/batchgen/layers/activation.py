"""Gated activations.

On CUDA one Triton kernel (kernels/silu_and_mul.py) computes silu(gate) * up, rounded as
the torch code below rounds; elsewhere the torch code runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.layers.norm import as_rows


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up, op by op."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up."""
    if x.is_cuda:
        from batchgen.kernels.silu_and_mul import silu_and_mul as fused

        out = fused(as_rows(x))
        return out.view(*x.shape[:-1], out.shape[-1])
    return silu_and_mul_torch(x)
