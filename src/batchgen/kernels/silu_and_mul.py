"""SiLU-and-mul of a stacked [gate | up] projection: one Triton program per tile.

    out = silu(gate) * up,   gate = x[:, :I], up = x[:, I:]

A program takes a tile of BLOCK_ROWS rows by BLOCK columns of the output (SiluTuning).
Where I is a multiple of 1,024 a program takes 1,024 columns of one row; elsewhere tiles
of 16 rows by 128 columns, which keep every lane busy (W4's routed experts, I = 1,408,
would leave 5/8 of a second 1,024-wide block idle). benchmarks/bench_kernels.py --silu on
an H200 (W4's 98,304 x 1,408 routed rows): 326 us one row a program, 206 us (95% of the
copy ceiling) in 16 x 128 tiles; at I = 1,024 and 11,264 one row a program is best.

Rounded as torch rounds `F.silu(gate) * up` in x's dtype: silu in float32 as
x / (1 + exp(-x)) (IEEE division, libdevice expf on CUDA: the functions torch's CUDA
kernel calls), rounded to the dtype; the product in float32, rounded once. The
interpreter has no libdevice, so on the CPU exp is numpy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import exp_as_torch, libdevice_exp, rne_by_hand, to_dtype

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SiluTuning:
    """Launch parameters: a program's tile is block_rows x block output elements (block
    at most the next power of two of I, so a narrow I is not padded further)."""

    block_rows: int = 1
    block: int = 1024
    num_warps: int = 4


WIDE_ROWS = SiluTuning()  # I a multiple of 1,024
TILES = SiluTuning(block_rows=16, block=128)  # any other I


def launch_for(inter: int) -> SiluTuning:
    """The launch for an output of I = `inter` columns."""
    return WIDE_ROWS if inter % WIDE_ROWS.block == 0 else TILES


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, num_rows, stride_x, stride_out, INTER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < INTER)
    x_at = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_at + INTER, mask=mask, other=0.0).to(tl.float32)
    e = exp_as_torch(-gate, LIBDEVICE_EXP)
    dtype = out_ptr.dtype.element_ty
    silu = to_dtype(tl.math.div_rn(gate, 1.0 + e), dtype, RNE_BY_HAND).to(tl.float32)
    out_at = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_at, to_dtype(silu * up, dtype, RNE_BY_HAND), mask=mask)


def silu_and_mul(
    x: torch.Tensor, *, out: torch.Tensor | None = None, tuning: SiluTuning | None = None
) -> torch.Tensor:
    """x [T, 2I] (rows may be strided, contiguous within a row) -> [T, I] in x's dtype;
    tuning None: launch_for(I)."""
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
        tuning = tuning or launch_for(inter)
        rows, block = tuning.block_rows, min(triton.next_power_of_2(inter), tuning.block)
        grid = (triton.cdiv(num_rows, rows), triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x, out, num_rows, x.stride(0), out.stride(0), INTER=inter, BLOCK_ROWS=rows,
            BLOCK=block, LIBDEVICE_EXP=libdevice_exp(x), RNE_BY_HAND=rne_by_hand(x),
            num_warps=tuning.num_warps,
        )  # fmt: skip
    return out
