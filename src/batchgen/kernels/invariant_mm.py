"""A batch-invariant matrix product: a persistent Triton GEMM with one fixed tiling.

    out[b] = a[b] @ w[b] (+ bias)      a [B, M, K], w [B, K, N] (any strides)

cuBLAS picks its kernel, its tile and whether to split the reduction (split-K) by the
shape, so a row of x W^T gets other bits when x has other rows. Here every launch uses
the same tile (InvariantTuning, never autotuned) and no split: each output tile sums K in
BLOCK_K steps from 0 up, in one program, and a row of a tile never meets another row's
values. A row's bits then depend on the row, the weight and the tuning alone, whatever M
is, whichever program takes the tile and whatever else the step holds
(layers/batch_invariant.py uses it for every product on CUDA in deterministic mode).

Persistent: a grid of at most `programs` programs (the device's multiprocessors), each
walking the tiles (batch, row block, column block) with a stride, so a large step launches
no more programs than the GPU holds. Float32 operands multiply in IEEE precision (no TF32),
bf16/fp16 on the tensor cores (kernels/mma.py), accumulation in float32, the result
rounded once to a's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma


@dataclass(frozen=True)
class InvariantTuning:
    """The one tiling every launch uses; a test may pass a smaller one (the interpreter
    is slow), never a launch chosen by shape."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


GPU_TUNING = InvariantTuning()


@triton.jit
def _invariant_mm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, B, M, N, K,
    stride_ab, stride_am, stride_ak, stride_wb, stride_wk, stride_wn,
    stride_ob, stride_om, stride_on,
    num_programs, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = B * tiles_m * tiles_n
    for tile in range(tl.program_id(0), num_tiles, num_programs):
        b = tile // (tiles_m * tiles_n)
        rest = tile % (tiles_m * tiles_n)
        rows = (rest // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (rest % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        a_at = a_ptr + b.to(tl.int64) * stride_ab + rows[:, None].to(tl.int64) * stride_am
        w_at = w_ptr + b.to(tl.int64) * stride_wb + cols[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_at + ks[None, :] * stride_ak,
                mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_at + ks[:, None] * stride_wk,
                mask=(ks[:, None] < K) & (cols[None, :] < N),
                other=0.0,
            )
            acc += mma(a, w, DOT_F32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_at = (
            out_ptr
            + b.to(tl.int64) * stride_ob
            + rows[:, None].to(tl.int64) * stride_om
            + cols[None, :] * stride_on
        )
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def invariant_bmm(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    tuning: InvariantTuning = GPU_TUNING,
    programs: int | None = None,
) -> torch.Tensor:
    """a [B, M, K] @ w [B, K, N] (+ bias [N]) -> [B, M, N] in a's dtype, every launch
    tiled by `tuning` (module docstring). programs: the persistent grid's size (None:
    the device's multiprocessors; 4 off CUDA)."""
    if a.dim() != 3 or w.dim() != 3 or a.shape[0] != w.shape[0] or a.shape[2] != w.shape[1]:
        raise ValueError(f"shapes {tuple(a.shape)} @ {tuple(w.shape)} do not multiply")
    if a.dtype != w.dtype or a.device != w.device:
        raise ValueError(f"a ({a.dtype}, {a.device}) and w ({w.dtype}, {w.device}) differ")
    batch, m, k = a.shape
    n = w.shape[2]
    out = torch.empty(batch, m, n, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if programs is None:
        programs = _multiprocessors(a.device) if a.is_cuda else 4
    tiles = batch * triton.cdiv(m, tuning.block_m) * triton.cdiv(n, tuning.block_n)
    programs = min(programs, tiles)
    _invariant_mm_kernel[(programs,)](
        a, w, a if bias is None else bias, out, batch, m, n, k,
        *a.stride(), *w.stride(), *out.stride(), programs,
        HAS_BIAS=bias is not None, DOT_F32=dot_in_f32(a),
        BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n, BLOCK_K=tuning.block_k,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tuning: InvariantTuning = GPU_TUNING,
    programs: int | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) through invariant_bmm: x [..., in], weight [out, in]."""
    rows = x.reshape(1, -1, x.shape[-1])
    out = invariant_bmm(rows, weight.t()[None], bias, tuning, programs)
    return out.view(*x.shape[:-1], weight.shape[0])
