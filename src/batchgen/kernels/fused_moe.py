"""Routed experts in Triton: one kernel per expert GEMM over token-sorted pairs.

The (token, expert) pairs are sorted by expert and each expert's group is padded to a
whole number of row blocks (`align_pairs`), so every block of BLOCK_M rows belongs to one
expert. A program multiplies one block by one column tile of that expert's weight,
reading its input rows and writing its output rows through the pair ids: the gather of
the token rows and the scatter back to pair order that the grouped-GEMM path runs as
separate copies happen inside the GEMMs.

    pairs (token t, slot j) -> pair id t * top_k + j
    sorted_ids: | expert 0's pair ids, padded | expert 1's, padded | ... | unused |
    block b: expert block_expert[b]; blocks past num_blocks (device scalar) return at once

Nothing is read back to the host: the grid is sized for the most blocks any routing can
need, so a decode step stays capturable in a CUDA graph. Expert parallel: pairs routed
outside this rank's block of experts are left out of every group, and their output rows
are not written (the caller masks them).

Whether this beats `torch._grouped_mm` at decode batch sizes is for
benchmarks/bench_kernels.py --moe to say on the GPU. The products go through `mma`:
float32 at IEEE precision (no TF32), and every product in float32 in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma


@dataclass(frozen=True)
class MoETuning:
    """Launch parameters; the blocks are at least 16 (tl.dot's smallest on the GPU)."""

    block_m: int = 16  # rows of one expert a program takes (decode: a few per expert)
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


TUNING = MoETuning()


@triton.jit
def block_pairs(ids_ptr, block_expert_ptr, pid_m, num_pairs,
                ROWS_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Row block pid_m of sorted_ids: its pair ids [BLOCK_M], which of them are pairs
    (not padding), their input rows and the block's expert (both int64). The expert
    GEMMs (here, fp8_moe, int4_moe) all start from it."""
    pair = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = (pair // ROWS_PER_TOKEN).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return pair, valid, row, expert


@triton.jit
def load_rows(a_ptr, row, valid, offs_k, K, stride_am):
    """The [BLOCK_M, BLOCK_K] tile of a's rows `row` at columns offs_k (zero where a
    pair is padding or a column is past K)."""
    mask = valid[:, None] & (offs_k[None, :] < K)
    return tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def store_pairs(out_ptr, tile, pair, valid, offs_n, N, stride_om):
    """tile [BLOCK_M, BLOCK_N] (in out's dtype) into the output rows of its pairs at
    columns offs_n; padding rows and columns past N are not written."""
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, tile, mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, ids_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om,
    ROWS_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pair, valid, row, expert = block_pairs(
        ids_ptr, block_expert_ptr, pid_m, num_pairs, ROWS_PER_TOKEN, BLOCK_M
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = load_rows(a_ptr, row, valid, offs_k, K, stride_am)
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        acc += mma(a, w, DOT_F32)
    store_pairs(out_ptr, acc.to(out_ptr.dtype.element_ty), pair, valid, offs_n, N, stride_om)


def sort_by_group(groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of group ids in [0, num_groups) -> (sorted ids, order): the values and
    permutation torch.sort(groups, stable=True) gives, with the keys narrowed first to the
    smallest integer type that holds them (the sorted ids stay in it: widen them before
    indexing with them). A radix sort makes one pass per key byte: uint8 keys (up to 256
    groups) take one pass where int64 ones take eight."""
    if num_groups <= 256:
        key = groups.to(torch.uint8)
    elif num_groups <= 2**15:
        key = groups.to(torch.int16)
    else:
        key = groups.to(torch.int32)
    return torch.sort(key, stable=True)


def align_pairs(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [P] (each pair's expert; num_experts for a pair this rank does not
    compute) -> sorted_ids [capacity] (pair ids grouped by expert, each group padded to
    a multiple of block_m with the id P, which no pair has), block_expert
    [capacity / block_m] (each block's expert), num_blocks [1] (blocks in use). capacity
    covers any routing of P pairs; nothing is read back to the host."""
    num_pairs = experts.numel()
    device = experts.device
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # each group's first row, unpadded
    sorted_experts, order = sort_by_group(experts, num_experts + 1)
    sorted_experts = sorted_experts.long()
    mine = sorted_experts < num_experts
    group = sorted_experts.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    # a pair outside this rank's experts goes to a dump slot past the capacity
    pos = torch.where(mine, padded_start[group] + rank, capacity)
    sorted_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids.index_put_((pos,), order)
    blocks = torch.arange(capacity // block_m, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, blocks, right=True).clamp(max=num_experts - 1)
    num_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    return sorted_ids[:capacity], block_expert.to(torch.int32), num_blocks


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    num_pairs: int,
    rows_per_token: int,
    tuning: MoETuning = TUNING,
) -> torch.Tensor:
    """out[p] = a[p // rows_per_token] @ w[expert of p]^T for every pair p in sorted_ids:
    a [rows, K], w [E, N, K] -> out [num_pairs, N] in a's dtype (rows of pairs in no
    group left unwritten)."""
    if a.stride(-1) != 1 or w.stride(-1) != 1 or not a.is_contiguous():
        raise ValueError("a and w must be contiguous in their last dimension")
    if a.shape[1] != w.shape[2] or a.dtype != w.dtype:
        raise ValueError(f"a {list(a.shape)} {a.dtype} and w {list(w.shape)} {w.dtype} differ")
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (block_expert.numel(), triton.cdiv(n, tuning.block_n))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, num_blocks,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n,
        BLOCK_K=tuning.block_k, DOT_F32=dot_in_f32(a),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out
