"""Batch-invariant arithmetic: a row's result that does not depend on the other rows of
its step (EngineConfig.deterministic).

A GEMM library picks its kernel, its blocking and its split of the reduction by the
shape it is handed: on the CPU, MKL computes a row of x W^T with other bits when x has
1 row, 2-15 rows or 16 and more, and with two threads it splits the reduction of some
shapes by the row count too. So the same prompt gives other logits alone than in a
batch, in a prefill chunk of 64 tokens than in one of 500, after a prefix-cache hit
than without. Here every product is taken in row tiles of a fixed shape instead:

- `linear(x, w, b)`: the rows of x in tiles of ROW_TILE rows (the last one padded),
  each tile a [ROW_TILE, in] x [in, out] product of one batched GEMM; a row's bits
  then depend on the row and the weight alone.
- `bmm(a, b)`: the same for batched products ([B, M, K] x [B, K, N]) whose M counts
  rows of the batch (MLA's absorbed query and output).
- `attend(q, k, v, q_pos, scale)`: attention over a sequence's keys in blocks of
  KV_BLOCK keys aligned to position 0, an online softmax carried from block to block in
  position order, each block's two products on a row tile of fixed shape. A query's
  result depends on its position and its sequence's keys alone: decode rows and prefill
  rows, one chunk or many, after a prefix hit or not, take the same steps. Blocks past
  a query's position add exactly nothing (scale 1, zero weights).

Reductions along a row (RMSNorm, softmax, log-softmax) already give a row the same bits
whatever the row count on the CPU (tests/layers/test_batch_invariant.py holds them to
it), and so do index ops and exact elementwise ops (+, *, /, sqrt). A transcendental
elementwise op (exp, sigmoid) on a contiguous tensor runs as one loop over all its
elements, vectorised but for a scalar tail whose bits differ: a narrow row (8 router
logits) takes the vector path in a batch and the scalar one alone. `pointwise(fn, x)`
pads each row to a multiple of POINTWISE_WIDTH elements, so that there is no tail.

On CUDA every product goes to kernels/invariant_mm.py instead: a persistent Triton GEMM
with one fixed tiling and no split of the reduction, invariant by construction (cuBLAS
picks its kernel by the shape, batch count included, so its batched GEMM promises
nothing). The row tiles and key blocks stay as on the CPU.

The mode is per thread, entered with `invariant_mode(True)` around the model's calls
(the runner's entry points); outside it every function here is the plain op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows of every product's tile (MKL takes 16 and more rows one way)
KV_BLOCK = 64  # keys a block of the attention's online softmax
POINTWISE_WIDTH = 64  # a multiple of every CPU vector loop's step (AVX-512: 32 floats)


class _Mode(threading.local):
    on = False


_mode = _Mode()


@contextmanager
def invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Within it (this thread), the functions here compute batch-invariantly when
    `enabled`; nests, restoring the outer setting on exit."""
    outer = _mode.on
    _mode.on = bool(enabled)
    try:
        yield
    finally:
        _mode.on = outer


def active() -> bool:
    """Whether this thread is inside invariant_mode(True)."""
    return _mode.on


def _tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, int]:
    """x [B, M, K] padded with zero rows to [B, ceil(M / tile) * tile, K]; returns it
    and M."""
    m = x.shape[1]
    pad = -m % tile
    return (F.pad(x, (0, 0, 0, pad)) if pad else x), m


def pointwise(fn, x: torch.Tensor, width: int = POINTWISE_WIDTH) -> torch.Tensor:
    """fn(x) for an elementwise fn; in invariant mode with x's rows (last dimension)
    padded to a multiple of `width` elements first, so that every element takes the
    vectorised path whatever the row count (module docstring)."""
    pad = -x.shape[-1] % width
    if not _mode.on or not pad:
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., : x.shape[-1]]


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, or on CUDA the fixed-tiling Triton GEMM."""
    if a.is_cuda:
        from batchgen.kernels.invariant_mm import invariant_bmm

        return invariant_bmm(a, b)
    return torch.bmm(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N] -> [B, M, N]: torch.bmm, or in invariant mode every
    [tile, K] x [K, N] row tile its own product of one batched GEMM."""
    if not _mode.on:
        return torch.bmm(a, b)
    batch, _, k = a.shape
    n = b.shape[-1]
    padded, m = _tiles(a, tile)
    nt = padded.shape[1] // tile
    tiles = padded.reshape(batch * nt, tile, k)
    weights = b[:, None].expand(batch, nt, k, n).reshape(batch * nt, k, n)
    return _product(tiles, weights).view(batch, nt * tile, n)[:, :m]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: int = ROW_TILE
) -> torch.Tensor:
    """F.linear(x, weight, bias), or in invariant mode the rows of x (every leading
    dimension) in row tiles of `tile` rows, each a [tile, in] x [in, out] product of
    one batched GEMM, the bias added after."""
    if not _mode.on:
        return F.linear(x, weight, bias)
    if x.is_cuda:
        from batchgen.kernels.invariant_mm import invariant_linear

        return invariant_linear(x, weight, bias)
    k = x.shape[-1]
    rows = x.reshape(1, -1, k)
    padded, m = _tiles(rows, tile)
    nt = padded.shape[1] // tile
    w = weight.t()
    out = torch.bmm(padded.view(nt, tile, k), w.expand(nt, *w.shape))
    out = out.view(nt * tile, weight.shape[0])[:m]  # 0 rows too (an idle EP rank's)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    tile: int = ROW_TILE,
    block: int = KV_BLOCK,
) -> torch.Tensor:
    """q [B, Q, H, Dk] at positions q_pos [B, Q]; k [B, S, Hk, Dk], v [B, S, Hk, Dv]
    (H a multiple of Hk; key s at position s) -> [B, Q, H, Dv] in float32. A query at
    position p attends to the keys at positions <= p (and > p - sliding_window), in
    blocks of `block` keys from position 0, its rows (query, head of a key head's group)
    in tiles of `tile` rows (module docstring)."""
    b, nq, h, dk = q.shape
    s, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hk
    rows = q.float().view(b, nq, hk, g, dk).permute(0, 2, 1, 3, 4).reshape(b * hk, nq * g, dk)
    pos = q_pos[:, None, :, None].expand(b, hk, nq, g).reshape(b * hk, nq * g, 1)
    rows, m = _tiles(rows, tile)
    pos, _ = _tiles(pos, tile)  # padding rows sit at position 0: key 0 alone
    nt = rows.shape[1] // tile
    n = b * hk * nt
    rows, pos = rows.reshape(n, tile, dk), pos.reshape(n, tile, 1)
    pad = -s % block
    keys = F.pad(k.float().permute(0, 2, 1, 3), (0, 0, 0, pad)).reshape(b * hk, s + pad, dk)
    values = F.pad(v.float().permute(0, 2, 1, 3), (0, 0, 0, pad)).reshape(b * hk, s + pad, dv)
    best = rows.new_full((n, tile, 1), float("-inf"))
    total = rows.new_zeros(n, tile, 1)
    acc = rows.new_zeros(n, tile, dv)
    for start in range(0, s, block):
        kb = keys[:, start : start + block, None].expand(b * hk, block, nt, dk)
        vb = values[:, start : start + block, None].expand(b * hk, block, nt, dv)
        kb = kb.permute(0, 2, 1, 3).reshape(n, block, dk)
        vb = vb.permute(0, 2, 1, 3).reshape(n, block, dv)
        scores = _product(rows, kb.transpose(1, 2)) * scale
        k_pos = torch.arange(start, start + block, device=q.device)
        allowed = k_pos <= pos
        if sliding_window is not None:
            allowed &= k_pos > pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        base = new_best.masked_fill(new_best == float("-inf"), 0.0)
        carry = pointwise(torch.exp, best - base)
        weights = torch.exp(scores - base)
        total = total * carry + weights.sum(-1, keepdim=True)
        acc = acc * carry + _product(weights, vb)
        best = new_best
    out = (acc / total).view(b * hk, nt * tile, dv)[:, :m]
    return out.reshape(b, hk, nq, g, dv).permute(0, 2, 1, 3, 4).reshape(b, nq, h, dv)
