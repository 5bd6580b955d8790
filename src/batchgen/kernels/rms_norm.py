"""RMSNorm of rows, optionally after a residual add: one Triton program per row.

    s = x + residual                      (in x's dtype: float32 sum rounded once)
    h = float32(s)
    h = h * rsqrt(mean(h * h) + eps)
    y = weight * h.to(x.dtype)            (product in float32, rounded once to y's dtype)

The op order of layers/norm.py (transformers' RMSNorm), so results agree with it bit for
bit except where the float32 sum of squares, taken in another order, rounds differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import rne_by_hand, to_dtype

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
    stride_res_out, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = to_dtype(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, RNE_BY_HAND)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=0) * (1.0 / N)  # torch's CUDA mean multiplies by 1/N too
    h = h * tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * to_dtype(h, x_ptr.dtype.element_ty, RNE_BY_HAND).to(tl.float32)
    y = to_dtype(y, out_ptr.dtype.element_ty, RNE_BY_HAND)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or (shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{name} must be {list(shape)} {dtype} with contiguous rows: "
            f"{list(t.shape)} {t.dtype} strides {t.stride()}"
        )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise the rows of x [T, N] and scale them by weight [N].

    Without `residual`: returns the normalised rows. With `residual` [T, N] (x's dtype):
    returns (normalised, new residual), new residual = x + residual rounded to x's dtype
    and written to a new tensor (or `residual_out`); the norm is taken over that sum.
    Inputs are never written. The output's dtype is torch's promotion of x's and weight's.
    Rows may be strided (contiguous within a row); T comes from the grid only.
    """
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, N] float32/bfloat16/float16: {list(x.shape)} {x.dtype}")
    num_rows, n = x.shape
    _check_rows("x", x, (num_rows, n), x.dtype)
    if weight.shape != (n,) or weight.dtype not in _DTYPES or (n > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous [{n}] float tensor: {list(weight.shape)}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty((num_rows, n), dtype=out_dtype, device=x.device)
    _check_rows("out", out, (num_rows, n), out_dtype)
    devices = {x.device, weight.device, out.device}
    if residual is not None:
        _check_rows("residual", residual, (num_rows, n), x.dtype)
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _check_rows("residual_out", residual_out, (num_rows, n), x.dtype)
        devices |= {residual.device, residual_out.device}
    elif residual_out is not None:
        raise ValueError("residual_out is only written when a residual is given")
    if len(devices) != 1:
        raise ValueError("x, weight, residual and the outputs must be on one device")
    if num_rows > 0:
        res = residual if residual is not None else x
        res_out = residual_out if residual_out is not None else out
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(num_rows,)](
            x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
            res_out.stride(0), eps, N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
            RNE_BY_HAND=rne_by_hand(x), num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    return out if residual is None else (out, residual_out)
