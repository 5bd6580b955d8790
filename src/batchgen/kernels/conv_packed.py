"""A step's short causal depthwise convolution over packed requests (prefill chunks and
single rows together), with SiLU, continuing each request from its slot-held window.

    ext_s = windows[slots[s]] ++ x[cu[s]:cu[s+1]]          (K - 1 + q_len rows)
    y[cu[s] + p, c] = silu(sum_j weight[c, j] * ext_s[p + j, c])
    windows[slots[s]] <- the last K - 1 rows of ext_s

Two launches on one stream. The first writes y, one program per block of packed rows and
block of channels; each row finds its request through `rows`, so a step that mixes one
long prompt with many one-row requests launches no idle programs. It reads the window for
a request's first K - 1 rows. The second moves each request's window on, after every read
of the old window by the first. A request of fewer than K - 1 rows keeps part of its old
window (shifted); a longer one takes its last K - 1 rows. Taps are summed in float32 and
SiLU applied there, the result rounded once to x's dtype (as kernels/conv_decode.py, the
decode-only step's kernel).

A KDA layer's q, k and v convolution (layers/kda_ops.py) in steps with a prefill. The
output comes as `parts` contiguous [T, C / parts] tensors (q, k and v), so the chunked
KDA kernels after it need no copy; fla-core's causal_conv1d gives one [T, C] tensor, its
thirds strided, and takes its initial states as [N, C, K] built from the windows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.conv_decode import conv_shapes

# (rows, channels, warps) of one program of the convolution
LAUNCH = (16, 256, 4)


@triton.jit
def _conv_packed_kernel(
    x_ptr, w_ptr, win_ptr, cu_ptr, slot_ptr, seq_ptr, out_ptr, channels, part_width,
    num_rows, stride_x, stride_wc, stride_wk, stride_ws, stride_wj,
    TAPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    seq = tl.load(seq_ptr + rows, mask=row_ok, other=0)  # each row's request
    first = tl.load(cu_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < channels
    live = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK), dtype=tl.float32)
    for j in tl.static_range(TAPS):
        src = rows - (TAPS - 1) + j  # ext row p + j: x row src, or window row K - 1 + src - first
        in_x = (src >= first)[:, None]
        xv = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=live & in_x, other=0.0)
        at = slot * stride_ws + (TAPS - 1 + src - first) * stride_wj
        wv = tl.load(win_ptr + at[:, None] + cols[None, :], mask=live & ~in_x, other=0.0)
        w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=col_ok, other=0.0)
        acc += (xv.to(tl.float32) + wv.to(tl.float32)) * w.to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    part = cols // part_width
    out_at = out_ptr + (part * (num_rows * part_width) + cols % part_width)[None, :]
    tl.store(out_at + rows[:, None] * part_width, y.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _window_kernel(
    x_ptr, win_ptr, cu_ptr, slot_ptr, channels, stride_x, stride_ws, stride_wj,
    TAPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_ptr + seq + 1).to(tl.int64) - first
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < channels
    win = win_ptr + tl.load(slot_ptr + seq).to(tl.int64) * stride_ws + cols
    # new row j is ext row q_len + j: old window row q_len + j (> j) while that is inside
    # the window, else x row q_len + j - (K - 1) of the request. Rows are written in
    # ascending order, each by the thread that reads its source, so no row is read after
    # it has been overwritten.
    for j in tl.static_range(TAPS - 1):
        e = q_len + j
        if e < TAPS - 1:
            v = tl.load(win + e * stride_wj, mask=mask)
        else:
            v = tl.load(x_ptr + (first + e - (TAPS - 1)) * stride_x + cols, mask=mask)
            v = v.to(win_ptr.dtype.element_ty)
        tl.store(win + j * stride_wj, v, mask=mask)


def request_of_row(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The request index of each packed row [num_rows] int64, on cu_seqlens' device (no
    host sync); a step's layers can share it (conv_packed's `rows`)."""
    rows = torch.arange(num_rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], rows, right=True)


def conv_packed(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    parts: int = 1,
    rows: torch.Tensor | None = None,
    launch: tuple[int, int, int] = LAUNCH,
) -> tuple[torch.Tensor, ...]:
    """x [T, C] (the step's rows, packed by request; rows may be strided), weight [C, K],
    windows [S, K - 1, C] (written in place: each request's window moves on by its rows),
    cu_seqlens [N + 1] and slots [N] int on x's device; rows: request_of_row(cu_seqlens,
    T), built here when not given -> `parts` contiguous tensors [T, C / parts] in x's
    dtype, the convolved channels in order. Slots must be distinct. One program per block
    of packed rows and of channels, whatever the mix of request lengths; `launch`: its
    rows, channels (powers of 2) and warps."""
    num_rows, channels, taps = conv_shapes(x, weight, windows, parts)
    n = slots.shape[0] if slots.dim() == 1 else -1
    if n < 0 or tuple(cu_seqlens.shape) != (n + 1,):
        raise ValueError(
            f"cu_seqlens [N + 1] and slots [N] expected: {list(cu_seqlens.shape)}, "
            f"{list(slots.shape)}"
        )
    for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64: {t.dtype}")
    if rows is None:
        rows = request_of_row(cu_seqlens, num_rows)
    if tuple(rows.shape) != (num_rows,):
        raise ValueError(f"rows must be [{num_rows}]: {list(rows.shape)}")
    if len({t.device for t in (x, weight, windows, cu_seqlens, slots, rows)}) != 1:
        raise ValueError("x, weight, windows, cu_seqlens, slots and rows must be on one device")
    width = channels // parts
    out = torch.empty((parts, num_rows, width), dtype=x.dtype, device=x.device)
    if num_rows and n:
        block_t, block_c, warps = launch
        block = min(block_c, triton.next_power_of_2(channels))
        _conv_packed_kernel[(triton.cdiv(num_rows, block_t), triton.cdiv(channels, block))](
            x, weight, windows, cu_seqlens, slots, rows, out, channels, width, num_rows,
            x.stride(0), weight.stride(0), weight.stride(1), windows.stride(0),
            windows.stride(1), TAPS=taps, BLOCK_R=block_t, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        block = min(LAUNCH[1], triton.next_power_of_2(channels))
        _window_kernel[(n, triton.cdiv(channels, block))](
            x, windows, cu_seqlens, slots, channels, x.stride(0), windows.stride(0),
            windows.stride(1), TAPS=taps, BLOCK=block,
        )  # fmt: skip
    return tuple(out.unbind(0))
