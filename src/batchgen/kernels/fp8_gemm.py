"""Block-scaled FP8 GEMM (W8A8): activations quantized per token in groups of the weight
block's width, weights float8_e4m3fn with one float32 scale per block, products summed in
float32 and scaled block by block, as DeepSeek-V3's checkpoints are meant to run:

    out[m, n] = sum over column blocks b of
                a_scale[m, b] * w_scale[n // block_n, b] * sum_{k in b} a[m, k] w[n, k]

    a        [M, K]                 float8_e4m3fn   (kernels/fp8_quant.quantize_groups)
    a_scale  [M, ceil(K / bk)]      float32
    w        [N, K]                 float8_e4m3fn   (the checkpoint's weight)
    w_scale  [ceil(N / bn), ceil(K / bk)]  float32 (its weight_scale_inv)

A program computes a BLOCK_M x BLOCK_N tile of out, walking K one weight block (bk
columns, BLOCK_K = bk) at a time: one FP8 tensor-core dot per block, accumulated in
float32 after the two scales. The bias is added in float32 and the sum rounded once to
the output dtype. With split_k (decode-sized M, few column tiles) each tile's K blocks
are shared among split_k programs writing float32 partials, which torch sums in a fixed
order before the bias and the one rounding. `block_scaled_mm_reference` is the same sum
in torch (float32).

On Hopper torch's own `torch.nn.functional.scaled_mm` takes this case too (ScalingType
BlockWise1x128 for a, BlockWise128x128 for w, 128-multiple shapes): `scaled_mm_blockwise`
calls it, for the device benchmark to measure against this kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8GemmTuning:
    """A program's output tile (BLOCK_K is the weight block's width), warps and stages;
    split_k > 1 splits the K blocks over that many programs a tile, their float32
    partials summed afterwards in a fixed order (no atomics: the same bits every run)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_tuning(
    m: int, device: torch.device, n: int | None = None, k_blocks: int | None = None
) -> Fp8GemmTuning:
    """Small tiles for decode-sized M (the weight read once by few programs' worth of
    rows), larger ones for prefill; in the interpreter the smallest that work. For a
    decode-sized M with n and k_blocks given, K is split until the tiles' programs
    about fill the GPU's SMs (a q_a_proj of 1,536 rows is 24 column tiles: a fifth of
    an H100 without it)."""
    if device.type != "cuda":
        return Fp8GemmTuning(block_m=16, block_n=32, num_warps=1, num_stages=1)
    if m <= 16:
        split = 1
        if n is not None and k_blocks is not None:
            tiles = -(-n // 64)
            split = max(1, min(8, k_blocks // 4, _num_sms(device.index or 0) // tiles))
        return Fp8GemmTuning(block_m=16, block_n=64, num_warps=4, num_stages=4, split_k=split)
    if m <= 64:
        return Fp8GemmTuning(block_m=32, block_n=128, num_warps=4, num_stages=3)
    return Fp8GemmTuning(block_m=64, block_n=128, num_warps=4, num_stages=3)


def block_scaled_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GEMM in float32 torch ops: a and w dequantized by their scales, then a w^T."""
    bn, bk = block
    a32 = a.float() * a_scale.repeat_interleave(bk, dim=1)[:, : a.shape[1]]
    w32 = (
        w.float()
        * w_scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
    )
    out = a32 @ w32.t()
    return out if bias is None else out + bias.float()


@triton.jit
def _block_scaled_mm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    ws_rows_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    stride_os,
    BLOCK_N_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_INDEX: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    as_rows = as_ptr + rows * stride_asm
    if ROW_INDEX:  # stacked shards starting inside blocks: each row's scale row given
        ws_row = tl.load(ws_rows_ptr + cols, mask=col_ok, other=0)
    else:
        ws_row = cols // BLOCK_N_W
    ws_cols = ws_ptr + ws_row * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    first = pid_s * per_split
    for b in range(first, tl.minimum(first + per_split, k_blocks)):
        k = b * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_s = tl.load(as_rows + b, mask=row_ok, other=0.0)
        w_s = tl.load(ws_cols + b, mask=col_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_s.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om
    out += cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    tuning: Fp8GemmTuning | None = None,
    w_scale_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [M, K] x w [N, K]^T with their scales (module docstring) -> [M, N] out_dtype.
    block = (rows, columns) of a weight block; a's groups are `columns` wide.
    w_scale_rows (int32 [N]): row n's scales are w_scale[w_scale_rows[n]] instead of
    w_scale[n // rows] (a stacked layer whose shards start inside blocks)."""
    bn, bk = block
    m, k = a.shape
    n = w.shape[0]
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a and w must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    if w.shape[1] != k or a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(
            f"a {tuple(a.shape)} and w {tuple(w.shape)}: K must match, rows contiguous"
        )
    if tuple(a_scale.shape) != (m, -(-k // bk)):
        raise ValueError(f"a_scale {tuple(a_scale.shape)} != ({m}, {-(-k // bk)})")
    if w_scale_rows is not None:
        if tuple(w_scale_rows.shape) != (n,) or w_scale_rows.dtype != torch.int32:
            raise ValueError(f"w_scale_rows must be int32 [{n}]")
        if w_scale.shape[1] != -(-k // bk):
            raise ValueError(f"w_scale {tuple(w_scale.shape)}: not {-(-k // bk)} column blocks")
    elif tuple(w_scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"w_scale {tuple(w_scale.shape)} != ({-(-n // bn)}, {-(-k // bk)})")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"the weight block's width must be a power of two >= 16, got {bk}")
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError("the scales must be float32")
    if m == 0:
        return torch.empty(m, n, dtype=out_dtype, device=a.device)
    t = tuning or default_tuning(m, a.device, n, -(-k // bk))
    split = max(1, min(t.split_k, -(-k // bk)))
    if split == 1:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    else:  # float32 partials, one [M, N] a split, summed below
        out = torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
    _block_scaled_mm_kernel[grid](
        a, a_scale, w, w_scale, w_scale if w_scale_rows is None else w_scale_rows,
        bias if bias is not None else w_scale, out,
        m, n, k, a.stride(0), a_scale.stride(0), w.stride(0), w_scale.stride(0),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        BLOCK_N_W=bn, BLOCK_K=bk, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        HAS_BIAS=bias is not None and split == 1, ROW_INDEX=w_scale_rows is not None,
        SPLIT_K=split, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if split == 1:
        return out
    total = out.sum(0)
    if bias is not None:
        total += bias.float()
    return total.to(out_dtype)


def scaled_mm_blockwise(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The same GEMM through torch's `scaled_mm` (CUDA, Hopper; 128 x 128 weight blocks,
    1 x 128 activation groups, K and N multiples of 128). torch wants a's scales
    outer-dimension-major (the transpose of a contiguous [K / 128, M]), and the weight's
    as blocks of its second operand w^T [K, N]: [K / 128, N / 128] (w_scale transposed;
    torch 2.11 refused [N / 128, K / 128] on an H100)."""
    from torch.nn.functional import ScalingType, scaled_mm

    a_scale = a_scale.t().contiguous().t()
    return scaled_mm(
        a,
        w.t(),
        a_scale,
        ScalingType.BlockWise1x128,
        w_scale.t(),
        ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )
