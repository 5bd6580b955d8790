"""The routed experts' weighted sum: each token's top_k expert rows, read where the
token-sorted GEMMs left them, summed in float32 and rounded once.

    out[t] = sum_j weights[t, j] * h[position[t * top_k + j]]      j = 0 .. top_k - 1

h [P, H] holds the pairs' expert outputs in sorted order (row r is pair order[r]) and
position is the inverse of order, so nothing is scattered back to pair order first, and
no float32 copy of all P rows is made: one pass reads each pair's row once and writes
the token's. A pair whose weight is 0 adds nothing, whatever its row holds (pairs routed
outside this rank's experts: no GEMM wrote their rows). The sum runs j = 0, 1, ... in
float32, as torch's float32 `sum(dim=1)` over top_k columns does for small top_k; the
result is rounded to h's dtype once.

With `residual` (the shared experts' output) the kernel adds it to the rounded sum and
rounds again, as `combined + residual` in h's dtype would, bit for bit: the layer's
output comes from the same pass, without a second one over [T, H] to add them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import rne_by_hand, to_dtype

_BLOCK = 1024


@triton.jit
def _moe_combine_kernel(
    h_ptr, position_ptr, weights_ptr, out_ptr, residual_ptr, stride_h, stride_out,
    stride_res, HIDDEN,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights_ptr + token * TOP_K + j)
        row = tl.load(position_ptr + token * TOP_K + j).to(tl.int64)
        x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(w != 0.0, w * x, 0.0)  # a NaN row times 0 would be NaN
    dtype = out_ptr.dtype.element_ty
    y = to_dtype(acc, dtype, RNE_BY_HAND)
    if HAS_RESIDUAL:  # (sum rounded) + residual, rounded: the unfused add's bits
        r = tl.load(residual_ptr + token * stride_res + cols, mask=mask, other=0.0)
        y = to_dtype(y.to(tl.float32) + r.to(tl.float32), dtype, RNE_BY_HAND)
    tl.store(out_ptr + token * stride_out + cols, y, mask=mask)


def moe_combine(
    h: torch.Tensor,
    position: torch.Tensor,
    weights: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [P, H] (rows contiguous), position [T * top_k] int64 (each pair's row of h),
    weights [T, top_k] float32 (0 for a pair that adds nothing) -> [T, H] in h's dtype;
    plus residual [T, H] (h's dtype, rows contiguous) where given."""
    if h.dim() != 2 or h.stride(1) != 1:
        raise ValueError(f"h must be [P, H] with contiguous rows: {list(h.shape)} {h.stride()}")
    if weights.dim() != 2 or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous [T, top_k] float32: {weights.dtype}")
    tokens, top_k = weights.shape
    if position.shape != (tokens * top_k,) or position.dtype != torch.int64:
        raise ValueError(f"position must be [{tokens * top_k}] int64: {list(position.shape)}")
    if not (h.device == position.device == weights.device):
        raise ValueError("h, position and weights must be on one device")
    hidden = h.shape[1]
    if out is None:
        out = torch.empty((tokens, hidden), dtype=h.dtype, device=h.device)
    if out.shape != (tokens, hidden) or out.dtype != h.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{tokens}, {hidden}] {h.dtype} with contiguous rows")
    if residual is not None and (
        residual.shape != (tokens, hidden)
        or residual.dtype != h.dtype
        or residual.stride(1) != 1
        or residual.device != h.device
    ):
        raise ValueError(
            f"residual must be [{tokens}, {hidden}] {h.dtype} with contiguous rows on "
            f"{h.device}: {list(residual.shape)} {residual.dtype} on {residual.device}"
        )
    if tokens and hidden:
        block = min(triton.next_power_of_2(hidden), _BLOCK)
        res = out if residual is None else residual  # a pointer the kernel never reads
        _moe_combine_kernel[(tokens, triton.cdiv(hidden, block))](
            h, position, weights, out, res, h.stride(0), out.stride(0), res.stride(0),
            hidden, TOP_K=top_k, BLOCK=block, RNE_BY_HAND=rne_by_hand(h),
            HAS_RESIDUAL=residual is not None, num_warps=4,
        )  # fmt: skip
    return out


def moe_combine_reference(
    h: torch.Tensor,
    position: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in plain torch: the rows back in pair order, weighted in float32, summed,
    rounded, then plus residual (in h's dtype) where given."""
    tokens, top_k = weights.shape
    per_pair = h.float()[position].view(tokens, top_k, -1)
    weighted = torch.where(weights.unsqueeze(-1) != 0, per_pair * weights.unsqueeze(-1), 0.0)
    out = weighted.sum(dim=1).to(h.dtype)
    return out if residual is None else out + residual
