"""SiLU-and-mul of a stacked [gate | up] projection: one Triton program per row block.

    out = silu(gate) * up,   gate = x[:, :I], up = x[:, I:]

Rounded as torch rounds `F.silu(gate) * up` in x's dtype: silu in float32 as
x / (1 + exp(-x)) (IEEE division, libdevice expf on CUDA: the functions torch's CUDA
kernel calls), rounded to the dtype; the product in float32, rounded once. The
interpreter has no libdevice, so on the CPU exp is numpy's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchgen.kernels.rounding import rne_by_hand, to_dtype

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    dtype = out_ptr.dtype.element_ty
    silu = to_dtype(tl.math.div_rn(gate, 1.0 + e), dtype, RNE_BY_HAND).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, to_dtype(silu * up, dtype, RNE_BY_HAND), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (rows may be strided, contiguous within a row) -> [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, 2I] float32/bfloat16/float16: {list(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous: strides {x.stride()}")
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if out.shape != (num_rows, inter) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_rows}, {inter}] {x.dtype} with contiguous rows")
    if out.device != x.device:
        raise ValueError("x and out must be on one device")
    if num_rows > 0 and inter > 0:
        block = min(triton.next_power_of_2(inter), _BLOCK)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block,
            LIBDEVICE_EXP=x.device.type == "cuda", RNE_BY_HAND=rne_by_hand(x), num_warps=4,
        )  # fmt: skip
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The same in plain torch, as layers/activation.py."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
