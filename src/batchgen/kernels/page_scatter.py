"""Scatter a load's staged pages into the device page pool: one Triton program per
(layer, page, component, block of a page's elements).

    staging [G, n, C, S, H, D]  (a group of layers' pages, in the order of `index`)
    pool    [L, C, P, S, H, D]  (the device pool; layers first..first+G written)
    pool[first + g, c, index[i]] = staging[g, i, c]

The same as `pool.transpose(1, 2)[first:first + G].index_copy_(1, index, staging)`
(its reference in tests/kernel_references.py), by a kernel of our own: the host tier's loads run it on
their copy stream, and the engine's graphs replayed slower for the rest of a run after
torch's indexing kernels ran there (see benchmarks/HISTORY.md), which this kernel is
measured against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _page_scatter_kernel(
    src_ptr, dst_ptr, index_ptr, first_layer, n, C: tl.constexpr, X, stride_dl, stride_dc,
    stride_dp, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (g, i, c) flattened, the staging's row order
    part = tl.program_id(1).to(tl.int64)
    c = row % C
    i = (row // C) % n
    g = row // (C * n)
    page = tl.load(index_ptr + i).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < X
    x = tl.load(src_ptr + row * X + offs, mask=mask)
    dst = dst_ptr + (first_layer + g) * stride_dl + c * stride_dc + page * stride_dp
    tl.store(dst + offs, x, mask=mask)


def page_scatter(
    pool: torch.Tensor, staging: torch.Tensor, index: torch.Tensor, first_layer: int = 0
) -> None:
    """pool[first_layer + g, c, index[i]] = staging[g, i, c] for every g, i, c, on the
    current stream. pool [L, C, P, ...] with each page's elements contiguous; staging
    [G, n, C, ...] contiguous; index int32/int64 [n] on the pool's device."""
    if pool.dim() < 4 or staging.dim() != pool.dim():
        raise ValueError(f"pool {tuple(pool.shape)} and staging {tuple(staging.shape)}")
    g, n, c = staging.shape[:3]
    if staging.shape[3:] != pool.shape[3:] or c != pool.shape[1]:
        raise ValueError(f"staging {tuple(staging.shape)} does not fit pool {tuple(pool.shape)}")
    if first_layer < 0 or first_layer + g > pool.shape[0]:
        raise ValueError(f"layers {first_layer}..{first_layer + g} outside {pool.shape[0]}")
    if index.shape != (n,) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be int32/int64 [{n}], got {index.dtype} {tuple(index.shape)}")
    if staging.dtype != pool.dtype or not (staging.device == pool.device == index.device):
        raise ValueError("pool, staging and index must share a device, pool and staging a dtype")
    x = staging[0, 0, 0].numel() if n else 0
    page = pool[0, 0, 0]
    if not staging.is_contiguous() or not page.is_contiguous() or pool.stride(2) < x:
        raise ValueError("staging must be contiguous and each pool page's elements too")
    if g * n * c == 0 or x == 0:
        return
    grid = (g * n * c, triton.cdiv(x, BLOCK))
    _page_scatter_kernel[grid](
        staging, pool, index, first_layer, n, c, x, pool.stride(0), pool.stride(1), pool.stride(2),
        BLOCK=BLOCK,
    )  # fmt: skip
