"""One decode step of a short causal depthwise convolution over slot-held windows, with
SiLU: one Triton program per (request, block of channels).

    y[n, c] = silu(sum_j weight[c, j] * ext[n, j, c]),  ext[n] = windows[slots[n]] | x[n]
    windows[slots[n]] <- ext[n, 1:]

A KDA layer's q, k and v convolution in a decode-only step (layers/kda_ops.py): x [N, C]
is the step's new row per request, windows [S, K - 1, C] every request's last K - 1 rows
(oldest first) by state slot, weight [C, K]. The torch code (kda_torch.short_conv_decode)
takes an index_select, a cat, an einsum, an index_copy and casts, about ten kernels a
layer; this is one, reading each window once and writing it shifted in place. Taps are
summed in float32 and SiLU applied there, the result rounded once to x's dtype (the
torch code sums in the weight's dtype). The output comes as `parts` contiguous
[N, C / parts] tensors (q, k and v for KDA), so that the kernels after need no copy.

Slots must be distinct among real rows; padded rows of a captured graph may share one
spare slot, whose window is then undefined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 512


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, win_ptr, slot_ptr, out_ptr, channels, part_width, num_rows,
    stride_x, stride_wc, stride_wk, stride_ws, stride_wj,
    TAPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < channels
    slot = tl.load(slot_ptr + n).to(tl.int64)
    win = win_ptr + slot * stride_ws + cols
    x = tl.load(x_ptr + n * stride_x + cols, mask=mask, other=0.0)
    w_at = w_ptr + cols * stride_wc
    # the taps oldest first, as conv_packed sums them: a row's bits are the same in a
    # decode-only step and in a mixed one (deterministic=True)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TAPS - 1):
        w = tl.load(w_at + j * stride_wk, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(win + j * stride_wj, mask=mask, other=0.0).to(tl.float32) * w
    w = tl.load(w_at + (TAPS - 1) * stride_wk, mask=mask, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * w
    # the window moves on: each row read (by the thread that writes it) before it is
    # overwritten, the new row last
    for j in tl.static_range(TAPS - 2):
        tl.store(win + j * stride_wj, tl.load(win + (j + 1) * stride_wj, mask=mask), mask=mask)
    tl.store(win + (TAPS - 2) * stride_wj, x.to(win_ptr.dtype.element_ty), mask=mask)
    y = acc / (1.0 + tl.exp(-acc))
    part = cols // part_width
    out_at = out_ptr + part * (num_rows * part_width) + n * part_width + cols % part_width
    tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=mask)


def conv_shapes(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, parts: int
) -> tuple[int, int, int]:
    """(rows, channels, taps) of a short convolution's x [rows, C] (contiguous rows),
    weight [C, K >= 2] and windows [S, K - 1, C] (contiguous along C) into `parts`
    outputs; ValueError naming what does not fit."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with contiguous rows: {list(x.shape)} {x.stride()}")
    rows, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight must be [{channels}, K >= 2]: {list(weight.shape)}")
    taps = weight.shape[1]
    if windows.dim() != 3 or tuple(windows.shape[1:]) != (taps - 1, channels):
        raise ValueError(f"windows must be [S, {taps - 1}, {channels}]: {list(windows.shape)}")
    if windows.stride(2) != 1:
        raise ValueError(f"windows must be contiguous along channels: {windows.stride()}")
    if parts < 1 or channels % parts:
        raise ValueError(f"parts={parts} does not divide {channels} channels")
    return rows, channels, taps


def conv_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    slots: torch.Tensor,
    parts: int = 1,
) -> tuple[torch.Tensor, ...]:
    """x [N, C] (rows may be strided), weight [C, K], windows [S, K - 1, C] (written in
    place: each slot's window moves on by x's row), slots [N] int -> `parts` contiguous
    tensors [N, C / parts] in x's dtype, the convolved channels in order."""
    rows, channels, taps = conv_shapes(x, weight, windows, parts)
    if slots.shape != (rows,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be [{rows}] int32/int64: {list(slots.shape)} {slots.dtype}")
    if len({t.device for t in (x, weight, windows, slots)}) != 1:
        raise ValueError("x, weight, windows and slots must be on one device")
    width = channels // parts
    out = torch.empty((parts, rows, width), dtype=x.dtype, device=x.device)
    if rows:
        block = min(BLOCK_C, triton.next_power_of_2(channels))
        _conv_decode_kernel[(rows, triton.cdiv(channels, block))](
            x, weight, windows, slots, out, channels, width, rows,
            x.stride(0), weight.stride(0), weight.stride(1), windows.stride(0),
            windows.stride(1), TAPS=taps, BLOCK=block,
        )  # fmt: skip
    return tuple(out.unbind(0))
