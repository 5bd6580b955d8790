"""W4A16: activations times INT4 group-quantized weights, unpacked in registers.

The weights are compressed-tensors' `pack-quantized` form (Kimi-K2-Thinking's routed
experts), kept packed on the device:

    weight_packed [N, K / 8] int32: word w of row n holds columns 8w .. 8w + 7, column
        8w + j in bits 4j .. 4j + 3 as q + 8 (q in [-8, 7], symmetric; no zero point)
    weight_scale  [N, K / G]: one scale per row and group of G columns (G 32 or 128)
    W[n, k] = q[n, k] * weight_scale[n, k // G]

A program multiplies BLOCK_M rows of x by a BLOCK_N column tile of W^T: each step loads
BLOCK_K / 8 words of each of its BLOCK_N weight rows, splits them into nibbles, scales
them in float32 and rounds once to the activations' dtype (the weights a model
dequantized to that dtype would hold), then one tensor-core product. Decode (few rows)
is bound by the weight bytes read: a quarter of bf16's. Where the tiles leave too few
programs to fill the GPU, SPLIT_K programs share a tile's K range and write float32
partial sums that torch adds in a fixed order (no atomics: the same bits every run).

`dequantize_int4` / `w4a16_reference` are the torch forms (float32), and what the CPU runs:
`int4_linear_torch` dequantizes BLOCK_ROWS weight rows at a time, never the whole matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma
from batchgen.kernels.rounding import rne_by_hand, to_dtype

PACK = 8  # 4-bit values in one int32


@dataclass(frozen=True)
class W4A16Tuning:
    """Launch parameters: blocks of at least 16 (tl.dot's smallest), block_k a multiple
    of 8 (whole words); split_k programs per output tile."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gather: bool = False  # unpack_tile's GATHER


DECODE_TUNING = W4A16Tuning(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
PREFILL_TUNING = W4A16Tuning(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
LARGE_TUNING = W4A16Tuning(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def choose_tuning(m: int, n: int, k: int, num_sms: int) -> W4A16Tuning:
    """The decode launch (block_m 16) up to 16 rows, the prefill one up to 256, 128-row
    tiles above (each weight tile unpacked once for more rows); split along K until the
    tiles give about one program per SM, each split keeping at least 4 block_k steps.
    First guesses until benchmarks/bench_int4.py has run on the device."""
    base = DECODE_TUNING if m <= 16 else PREFILL_TUNING if m <= 256 else LARGE_TUNING
    tiles = triton.cdiv(m, base.block_m) * triton.cdiv(n, base.block_n)
    split = 1
    while tiles * split * 2 <= num_sms and k // (base.block_k * split * 2) >= 4:
        split *= 2
    return dataclasses.replace(base, split_k=split)


@triton.jit
def unpack_tile(packed_ptr, scale_ptr, offs_n, k0, N, K, stride_pn, stride_sn,
                GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                GATHER: tl.constexpr):  # fmt: skip
    """W^T[k0 : k0 + BLOCK_K, offs_n] in float32 (rows past N and groups past K: 0 by
    their zero scales; columns past K inside K's last group are finite, for the caller
    to multiply by masked-out zeros). GATHER: each of the tile's BLOCK_K rows loads its
    word (8 loads of a word, from the cache) and shifts out its nibble; else each word is
    loaded once and split into 8 rows by a reshape: bench_int4.py times both. The scales
    are loaded one per (group, column), [BLOCK_K / GROUP, BLOCK_N] or one row where a
    group spans the tile (BLOCK_K and GROUP nest), not one per weight: a tile of 64-bit
    pointers per weight is what filled the registers."""
    mask_n = offs_n < N
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if GATHER:
        packed = tl.load(
            packed_ptr + offs_n[None, :] * stride_pn + (offs_k // 8)[:, None],
            mask=mask_n[None, :] & (offs_k[:, None] < K),
            other=0,
        )
        q = ((packed >> ((offs_k % 8) * 4)[:, None]) & 0xF) - 8
    else:
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(
            packed_ptr + offs_n[None, :] * stride_pn + words[:, None],
            mask=mask_n[None, :] & (words[:, None] < tl.cdiv(K, 8)),
            other=0,
        )
        shifts = tl.arange(0, 8) * 4
        nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, N]
        q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)) - 8  # row 8w + j: nibble j of word w
    if BLOCK_K <= GROUP:  # one group: a scale per column
        scale = tl.load(scale_ptr + offs_n * stride_sn + k0 // GROUP, mask=mask_n, other=0.0)
        w = q.to(tl.float32) * scale.to(tl.float32)[None, :]
    else:
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(
            scale_ptr + offs_n[None, :] * stride_sn + groups[:, None],
            mask=mask_n[None, :] & (groups[:, None] < tl.cdiv(K, GROUP)),
            other=0.0,
        )
        by_group = tl.reshape(q, (BLOCK_K // GROUP, GROUP, BLOCK_N)).to(tl.float32)
        w = tl.reshape(by_group * scale.to(tl.float32)[:, None, :], (BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _w4a16_kernel(
    x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_pn, stride_sn, stride_os, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    GATHER: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        w = unpack_tile(packed_ptr, scale_ptr, offs_n, k0, N, K, stride_pn, stride_sn,
                        GROUP, BLOCK_K, BLOCK_N, GATHER)  # fmt: skip
        acc += mma(x, to_dtype(w, x_ptr.dtype.element_ty, RNE_BY_HAND), DOT_F32)
    out = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    acc = to_dtype(acc, out_ptr.dtype.element_ty, RNE_BY_HAND)
    tl.store(out, acc, mask=mask_m[:, None] & (offs_n[None, :] < N))


def check_packed(packed: torch.Tensor, scale: torch.Tensor, k: int, group_size: int) -> None:
    """ValueError unless packed [..., N, ceil(K / 8)] int32 and scale [..., N, ceil(K / G)]
    fit one weight of K input columns in groups of group_size (a multiple of 8)."""
    if group_size % PACK:
        raise ValueError(f"group size {group_size} is not a multiple of {PACK}")
    want_p = (*scale.shape[:-1], triton.cdiv(k, PACK))
    want_s = (*packed.shape[:-1], triton.cdiv(k, group_size))
    if packed.dtype != torch.int32 or tuple(packed.shape) != want_p:
        raise ValueError(f"packed {packed.dtype} {list(packed.shape)}: want int32 {list(want_p)}")
    if tuple(scale.shape) != want_s or not scale.is_floating_point():
        raise ValueError(f"scale {scale.dtype} {list(scale.shape)}: want float {list(want_s)}")


def check_nesting(block_k: int, group_size: int) -> None:
    """ValueError unless a K tile holds whole groups or lies inside one (unpack_tile)."""
    if block_k % group_size and group_size % block_k:
        raise ValueError(f"block_k {block_k} and group size {group_size} do not nest")


def w4a16_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    tuning: W4A16Tuning | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ W^T -> [M, N] in x's dtype, W [N, K] given as
    packed [N, K / 8] int32 and scale [N, K / group_size] (see the module docstring).
    tuning None: choose_tuning for M. Nothing read back from the device; capturable."""
    m, k = x.shape
    check_packed(packed, scale, k, group_size)
    if x.stride(-1) != 1 or packed.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("x, packed and scale must be contiguous in their last dimension")
    if k % PACK:
        raise ValueError(f"K = {k} is not a multiple of {PACK}")
    n = packed.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if tuning is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        tuning = choose_tuning(m, n, k, sms)
    check_nesting(tuning.block_k, group_size)
    k_per_split = triton.cdiv(triton.cdiv(k, tuning.split_k), tuning.block_k) * tuning.block_k
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tuning.block_m), triton.cdiv(n, tuning.block_n), split)
    _w4a16_kernel[grid](
        x, packed, scale, target, m, n, k, k_per_split,
        x.stride(0), packed.stride(0), scale.stride(0),
        target.stride(0) if split > 1 else 0, target.stride(-2),
        GROUP=group_size, BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n,
        BLOCK_K=tuning.block_k, DOT_F32=dot_in_f32(x), RNE_BY_HAND=rne_by_hand(x),
        GATHER=tuning.gather, num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    if split > 1:  # the partial sums in split order, rounded once
        out.copy_(target.sum(0))
    return out


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """packed [..., ceil(K / 8)] int32 -> q [..., K] int8 in [-8, 7] (torch ops)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.flatten(-2)[..., :k] - 8).to(torch.int8)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, k: int, group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """W [..., N, K] = q * scale per group, computed in float32 and rounded once to
    `dtype` (float32: exact, a bf16 scale times a small integer)."""
    q = unpack_int4(packed, k).to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :k]
    return (q * s).to(dtype)


def w4a16_reference(x: torch.Tensor, packed, scale, group_size: int) -> torch.Tensor:
    """x @ W^T over the whole weight dequantized to x's dtype (as the kernel rounds it),
    products summed in float32, rounded once to x's dtype."""
    w = dequantize_int4(packed, scale, x.shape[-1], group_size, x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


BLOCK_ROWS = 1024  # weight rows the CPU path dequantizes at a time


def int4_linear_torch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    block_rows: int = BLOCK_ROWS,
) -> torch.Tensor:
    """F.linear(x, W, bias) with W dequantized to x's dtype block_rows rows at a time
    (what the CPU runs; a model never holds a dequantized copy of its weights)."""
    k = x.shape[-1]
    n = packed.shape[0]
    if n <= block_rows:
        return F.linear(x, dequantize_int4(packed, scale, k, group_size, x.dtype), bias)
    out = x.new_empty(*x.shape[:-1], n)
    for start in range(0, n, block_rows):
        end = min(start + block_rows, n)
        w = dequantize_int4(packed[start:end], scale[start:end], k, group_size, x.dtype)
        out[..., start:end] = F.linear(x, w, None if bias is None else bias[start:end])
    return out
