"""Routed experts with INT4 weights: kernels/fused_moe.py's expert GEMM over token-sorted
pairs, each expert's weight read packed and unpacked in registers (int4_gemm's tile).

    w_packed [E, N, K / 8] int32, w_scale [E, N, K / G]: expert e's W [N, K] as
    kernels/int4_gemm.py describes one weight

The pairs come grouped by expert and padded to row blocks of one expert
(`fused_moe.align_pairs`); a program multiplies one block by one column tile of its
expert's weight, reading input rows and writing output rows through the pair ids, and
returns at once past the blocks in use, so nothing is read back to the host and a
decode step stays capturable. MoE decode is bound by reading expert weights: INT4 reads
a quarter of bf16's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.fused_moe import MoETuning, block_pairs, load_rows, store_pairs
from batchgen.kernels.int4_gemm import check_nesting, check_packed, unpack_tile
from batchgen.kernels.mma import dot_in_f32, mma
from batchgen.kernels.rounding import rne_by_hand, to_dtype


@dataclass(frozen=True)
class Int4MoETuning(MoETuning):
    """MoETuning and how a weight tile is unpacked (int4_gemm.unpack_tile's GATHER)."""

    gather: bool = False


TUNING = Int4MoETuning(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)


def tuning_for(num_pairs: int, num_experts: int) -> Int4MoETuning:
    """A launch for num_pairs pairs over num_experts experts (host ints: the step's
    shape, nothing read back): row blocks about as tall as an expert's share of the
    pairs, so each expert's packed tiles are read by as few blocks as its rows need
    (a decode step of Kimi-K2, 512 x 8 pairs over 384 experts: 16; W6's, 512 x 6 over
    64: ~48 rows each, 64; prefill chunks past 96 rows an expert: 128, each unpacked
    weight tile serving more rows). First guesses until benchmarks/bench_int4.py has run on the
    device."""
    rows = num_pairs / max(1, num_experts)
    if rows <= 16:
        return TUNING
    if rows <= 32:
        return Int4MoETuning(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows <= 96:
        return Int4MoETuning(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    # 128 x 128 tiles spill registers here (ptxas for sm_90: 528 bytes); 128 x 64 do not
    return Int4MoETuning(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)


@triton.jit
def _int4_moe_kernel(
    a_ptr, packed_ptr, scale_ptr, out_ptr, ids_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, N, K, stride_am, stride_pe, stride_pn, stride_se, stride_sn, stride_om,
    GROUP: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    RNE_BY_HAND: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pair, valid, row, expert = block_pairs(
        ids_ptr, block_expert_ptr, pid_m, num_pairs, ROWS_PER_TOKEN, BLOCK_M
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    packed_base = packed_ptr + expert * stride_pe
    scale_base = scale_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = load_rows(a_ptr, row, valid, offs_k, K, stride_am)
        w = unpack_tile(packed_base, scale_base, offs_n, k0, N, K, stride_pn, stride_sn,
                        GROUP, BLOCK_K, BLOCK_N, GATHER)  # fmt: skip
        acc += mma(a, to_dtype(w, a_ptr.dtype.element_ty, RNE_BY_HAND), DOT_F32)
    tile = to_dtype(acc, out_ptr.dtype.element_ty, RNE_BY_HAND)
    store_pairs(out_ptr, tile, pair, valid, offs_n, N, stride_om)


def int4_moe_gemm(
    a: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    num_pairs: int,
    rows_per_token: int,
    tuning: MoETuning = TUNING,
) -> torch.Tensor:
    """out[p] = a[p // rows_per_token] @ W[expert of p]^T for every pair p in sorted_ids
    (`fused_moe.align_pairs` with tuning.block_m): a [rows, K], W as w_packed [E, N, K /
    8] int32 and w_scale [E, N, K / group_size] -> out [num_pairs, N] in a's dtype (rows
    of pairs in no group left unwritten)."""
    if not a.is_contiguous() or w_packed.stride(-1) != 1 or w_scale.stride(-1) != 1:
        raise ValueError("a must be contiguous, w_packed and w_scale in their last dimension")
    k = a.shape[1]
    if k % 8 or w_packed.dim() != 3:
        raise ValueError(f"a {list(a.shape)} and w_packed {list(w_packed.shape)} do not fit")
    check_packed(w_packed, w_scale, k, group_size)
    check_nesting(tuning.block_k, group_size)
    n = w_packed.shape[1]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (block_expert.numel(), triton.cdiv(n, tuning.block_n))
    _int4_moe_kernel[grid](
        a, w_packed, w_scale, out, sorted_ids, block_expert, num_blocks,
        num_pairs, n, k, a.stride(0), w_packed.stride(0), w_packed.stride(1),
        w_scale.stride(0), w_scale.stride(1), out.stride(0),
        GROUP=group_size, ROWS_PER_TOKEN=rows_per_token, BLOCK_M=tuning.block_m,
        BLOCK_N=tuning.block_n, BLOCK_K=tuning.block_k, DOT_F32=dot_in_f32(a),
        RNE_BY_HAND=rne_by_hand(a), GATHER=getattr(tuning, "gather", False),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out
