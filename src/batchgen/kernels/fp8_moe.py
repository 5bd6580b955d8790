"""Routed experts' GEMMs over block-scaled FP8 weights (W8A8), over token-sorted pairs as
kernels/fused_moe.py's `moe_gemm` walks them (`align_pairs` blocks: every block of
BLOCK_M rows belongs to one expert; input rows read and output rows written through the
pair ids; nothing read back to the host, so a decode step stays capturable).

    a        [rows, K]   float8_e4m3fn, a_scale [rows, ceil(K / bk)] float32
                         (kernels/fp8_quant.quantize_groups: each token once)
    w        [E, N, K]   float8_e4m3fn, w_scale [E, ceil(N / bn), ceil(K / bk)] float32
    out[p] = sum over K blocks b of a_scale[row, b] * w_scale[e, n // bn, b] *
             (a[row, b] . w[e, n, b]),  row = p // rows_per_token, e = p's expert

One FP8 tensor-core dot per weight block (BLOCK_K = bk), summed in float32 after the two
scales, rounded once to the output dtype. Reference: `fp8_moe_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.fused_moe import MoETuning, block_pairs, load_rows, store_pairs

TUNING = MoETuning(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)


def tuning_for(num_pairs: int, num_experts: int) -> MoETuning:
    """A launch for num_pairs pairs over num_experts experts (host ints: the step's
    shape, nothing read back): row blocks about as tall as an expert's share of the
    pairs, so each expert's weight tile is read by as few blocks as its rows need
    (decode: 16; a 512-row step over 64 experts, top 6: ~48 rows each, 64). First
    guesses until benchmarks/bench_fp8.py has run on the device."""
    rows = num_pairs / max(1, num_experts)
    if rows <= 16:
        return TUNING
    if rows <= 32:
        return MoETuning(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return MoETuning(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)


@triton.jit
def _fp8_moe_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, ids_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
    stride_om,
    ROWS_PER_TOKEN: tl.constexpr, BLOCK_N_W: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pair, valid, row, expert = block_pairs(
        ids_ptr, block_expert_ptr, pid_m, num_pairs, ROWS_PER_TOKEN, BLOCK_M
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    ws_base = ws_ptr + expert * stride_wse + (offs_n // BLOCK_N_W) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = b * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = load_rows(a_ptr, row, valid, offs_k, K, stride_am)
        w = tl.load(w_base + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + row * stride_asm + b, mask=valid, other=0.0)
        w_s = tl.load(ws_base + b, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    store_pairs(out_ptr, acc.to(out_ptr.dtype.element_ty), pair, valid, offs_n, N, stride_om)


def fp8_moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    num_pairs: int,
    rows_per_token: int,
    out_dtype: torch.dtype,
    tuning: MoETuning = TUNING,
) -> torch.Tensor:
    """out[p] for every pair p in sorted_ids (module docstring) -> [num_pairs, N]
    out_dtype; rows of pairs in no group are left unwritten. tuning.block_k is taken as
    the weight block's width (block[1])."""
    bn, bk = block
    n, k = w.shape[1], w.shape[2]
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a and w must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    if a.shape[1] != k or a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(
            f"a {tuple(a.shape)} and w {tuple(w.shape)}: K must match, rows contiguous"
        )
    if tuple(a_scale.shape) != (a.shape[0], -(-k // bk)):
        raise ValueError(f"a_scale {tuple(a_scale.shape)} != ({a.shape[0]}, {-(-k // bk)})")
    want = (w.shape[0], -(-n // bn), -(-k // bk))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"w_scale {tuple(w_scale.shape)} != {want}")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"the weight block's width must be a power of two >= 16, got {bk}")
    out = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (block_expert.numel(), triton.cdiv(n, tuning.block_n))
    _fp8_moe_kernel[grid](
        a, a_scale, w, w_scale, out, sorted_ids, block_expert, num_blocks,
        num_pairs, n, k, a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1),
        w_scale.stride(0), w_scale.stride(1), out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, BLOCK_N_W=bn, BLOCK_M=tuning.block_m,
        BLOCK_N=tuning.block_n, BLOCK_K=bk,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out


def fp8_moe_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    experts: torch.Tensor,
    rows_per_token: int,
) -> torch.Tensor:
    """float32 out [P, N] for pairs p = 0..P-1 with experts [P] (num_experts or more: a
    pair computed nowhere, left zero), each row dequantized and multiplied in torch."""
    from batchgen.kernels.fp8_gemm import block_scaled_mm_reference

    num_experts = w.shape[0]
    out = torch.zeros(experts.numel(), w.shape[1], device=a.device)
    for p, e in enumerate(experts.tolist()):
        if e < num_experts:
            r = p // rows_per_token
            out[p] = block_scaled_mm_reference(
                a[r : r + 1], a_scale[r : r + 1], w[e], w_scale[e], block
            )[0]
    return out
