"""Absorbed MLA decode attention (DeepSeek-V3, Kimi-K2) over the paged latent cache.

One latent row per token, key and value of one head shared by all H query heads:

    latent[page, slot] = [ kv_norm(c_kv): kv_lora_rank C | k_pe (rope'd): rope_dim R ]
                           key and value                   key only
    out[b, h] = sum_t softmax_t(scale * (q_nope[b, h].c_kv[t] + q_pe[b, h].k_pe[t])) c_kv[t]

q_nope has W_UK already folded in ("absorbed"); the caller applies W_UV to out.

Stage 1, one program per (head block, request, split): BLOCK_H query heads are one tile,
so a latent row is read once per split for all of them (with H > BLOCK_H, the head
blocks of one (request, split) are launched next to each other and share it through
L2). The sequence is split as in decode_attention:

    tokens of request b:  [ 0 ................................ seq_len )
                            | split 0 | split 1 | ... | split S-1 |    (each a multiple of BLOCK_N)

Each program walks its tokens with an online softmax and writes its normalised partial
output and log-sum-exp (base 2). Stage 2, one program per (query head, request), merges
the splits; with one split, stage 1 writes the output directly. The launch grids depend
on shapes and the split count only (never on seq_lens): CUDA-graph capturable.
Math in float32; q_nope, q_pe and out share one dtype (bf16, fp16 or fp32), the latent
theirs or float8_e4m3fn (kv_cache_dtype "fp8", scale 1.0: batchgen/kv_quant.py), upcast
to theirs as each block of tokens is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.decode_attention import choose_num_splits
from batchgen.kernels.mma import dot_in_f32, mma
from batchgen.kv_quant import FP8

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_split_kernel(
    q_nope_ptr, q_pe_ptr, latent_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, rows_ptr,
    page_table_ptr, seq_lens_ptr, scale_log2, stride_qn_t, stride_qn_h, stride_qn_d,
    stride_qp_t, stride_qp_h, stride_qp_d, stride_lp, stride_ls, stride_ld, stride_ot,
    stride_oh, stride_od, stride_pt, stride_pw, stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    NUM_HEADS: tl.constexpr, LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    head_block = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b64
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < NUM_HEADS
    c_mask = offs_c < LORA_RANK
    r_mask = offs_r < ROPE_DIM
    q_rows = heads[:, None].to(tl.int64)
    q_nope = tl.load(
        q_nope_ptr + row * stride_qn_t + q_rows * stride_qn_h + offs_c[None, :] * stride_qn_d,
        mask=h_mask[:, None] & c_mask[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + row * stride_qp_t + q_rows * stride_qp_h + offs_r[None, :] * stride_qp_d,
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table = page_table_ptr + b64 * stride_pt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        page = tl.load(table + (pos // PAGE_SIZE) * stride_pw, mask=n_mask, other=0)
        token = page.to(tl.int64) * stride_lp + (pos % PAGE_SIZE).to(tl.int64) * stride_ls
        c = tl.load(
            latent_ptr + token[:, None] + offs_c[None, :] * stride_ld,
            mask=n_mask[:, None] & c_mask[None, :],
            other=0.0,
        ).to(q_nope.dtype)
        pe = tl.load(
            latent_ptr + token[:, None] + (LORA_RANK + offs_r)[None, :] * stride_ld,
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(q_nope.dtype)
        qk = mma(q_nope, tl.trans(c), DOT_F32) + mma(q_pe, tl.trans(pe), DOT_F32)
        qk = tl.where(n_mask[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(c.dtype), c, DOT_F32)
        m_i = m_new

    # an empty split (lo >= hi, also every split of a padding row with seq_len 0) has
    # l_i = 0: it stores zeros and lse = -inf, weight 0 in stage 2
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_mask = h_mask[:, None] & c_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + row * stride_ot + q_rows * stride_oh + offs_c[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        mid = mid_o_ptr + b64 * stride_mo_b + split * stride_mo_s
        tl.store(mid + q_rows * stride_mo_h + offs_c[None, :], o, mask=o_mask)
        tl.store(mid_lse_ptr + b64 * stride_ml_b + heads * stride_ml_h + split, lse, mask=h_mask)


@triton.jit
def _mla_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, rows_ptr, stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h, stride_ot, stride_oh, stride_od, LORA_RANK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < LORA_RANK
    lse_ptr = mid_lse_ptr + b * stride_ml_b + h * stride_ml_h
    lse = tl.load(lse_ptr + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: seq_len 0
    total = tl.sum(tl.exp2(lse - top), 0)
    mid = mid_o_ptr + b * stride_mo_b + h * stride_mo_h
    acc = tl.zeros([BLOCK_C], tl.float32)
    for s in range(NUM_SPLITS):  # one split's [C] row at a time: no [S, C] tile in registers
        w = tl.exp2(tl.load(lse_ptr + s) - top)
        acc += w * tl.load(mid + s * stride_mo_s + offs_c, mask=c_mask, other=0.0)
    acc = acc / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + row * stride_ot + h * stride_oh + offs_c * stride_od
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class MLADecodeTuning:
    """Launch parameters of the split kernel: BLOCK_H query heads per program (a power
    of two >= 16), BLOCK_N tokens per step (>= 16)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


# Measured on an H200 (benchmarks/mla_decode.py --sweep --heads 16 --batch 256 --ctx 1024,
# pages of 16, triton 3.6; benchmarks/HISTORY.md, 2026-12-01): 137 us (47% of HBM peak) against
# 227 us (29%) for the 8-warp, 2-stage launch chosen earlier from ptxas alone; W4 went
# from 4,287 to 4,869 output tok/s with it.
GPU_TUNING = MLADecodeTuning(block_h=16, block_n=32, num_warps=4, num_stages=3)
GPU_TUNING_F32 = MLADecodeTuning(block_h=16, block_n=16, num_warps=4, num_stages=1)
CPU_TUNING = MLADecodeTuning(block_h=16, block_n=16, num_warps=4, num_stages=1)


def default_tuning(dtype: torch.dtype, device: torch.device) -> MLADecodeTuning:
    if device.type != "cuda":
        return CPU_TUNING
    return GPU_TUNING_F32 if dtype == torch.float32 else GPU_TUNING


def head_blocks(num_heads: int, tuning: MLADecodeTuning) -> int:
    """Programs per (request, split): what the GQA kernel's KV heads are to its grid."""
    return triton.cdiv(num_heads, tuning.block_h)


def choose_mla_num_splits(
    batch: int,
    num_heads: int,
    max_seq_len: int,
    device: torch.device,
    tuning: MLADecodeTuning,
) -> int:
    """The split count decode_attention would pick for `head_blocks` KV heads: a power of
    two, a function of host ints only. A CUDA-graph plan gets the same numbers from
    `DecodeSplitPlan(max_bs, head_blocks(num_heads, tuning), max_len, device)`."""
    return choose_num_splits(batch, head_blocks(num_heads, tuning), max_seq_len, device)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tuning: MLADecodeTuning | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of one query per request over its paged latent rows.

    q_nope [B, H, C] (W_UK absorbed) and q_pe [B, H, R], or with `rows` [B] the packed
    [T, H, *] whose row rows[b] is request b's query; latent [P, page_size, 1, C + R] or
    [P, page_size, C + R] (any strides); page_table [B, W] int32/int64 with W >=
    ceil(seq_len / page_size) (entries past that are never read); seq_lens [B] int32/int64
    (the new token's row included; 0 gives zeros). Writes out [B or T, H, C] (like q_nope;
    allocated when None) at the same rows and returns it. The split count is num_splits,
    else chosen from max_seq_len (a host int; the page table's width bounds it when None):
    never from seq_lens, so nothing is read back from the device.
    """
    latent = _check(q_nope, q_pe, latent, page_table, seq_lens, rows, out, num_splits)
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q_nope)
    if batch == 0:
        return out
    page_size = latent.shape[1]
    num_heads, lora_rank = q_nope.shape[1], q_nope.shape[2]
    rope_dim = q_pe.shape[2]
    tuning = tuning or default_tuning(q_nope.dtype, q_nope.device)
    if num_splits is None:
        bound = page_table.shape[1] * page_size if max_seq_len is None else max_seq_len
        num_splits = choose_mla_num_splits(batch, num_heads, bound, q_nope.device, tuning)
    f32 = dict(dtype=torch.float32, device=q_nope.device)
    if num_splits > 1:
        mid_o = torch.empty(batch, num_heads, num_splits, lora_rank, **f32)
        mid_lse = torch.empty(batch, num_heads, num_splits, **f32)
    else:  # unused by the kernel; any float32 tensors with the right rank do
        mid_o, mid_lse = torch.empty(1, 1, 1, 1, **f32), torch.empty(1, 1, 1, **f32)
    rows_arg = rows if rows is not None else seq_lens
    block_c = max(16, triton.next_power_of_2(lora_rank))
    grid = (head_blocks(num_heads, tuning), batch, num_splits)
    _mla_split_kernel[grid](
        q_nope, q_pe, latent, out, mid_o, mid_lse, rows_arg, page_table, seq_lens,
        softmax_scale * _LOG2E, *q_nope.stride(), *q_pe.stride(), *latent.stride(),
        *out.stride(), *page_table.stride(), *mid_o.stride()[:3], *mid_lse.stride()[:2],
        NUM_HEADS=num_heads, LORA_RANK=lora_rank, ROPE_DIM=rope_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, HAS_ROWS=rows is not None, DOT_F32=dot_in_f32(q_nope),
        BLOCK_H=tuning.block_h, BLOCK_N=tuning.block_n, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _mla_merge_kernel[(num_heads, batch)](
            mid_o, mid_lse, out, rows_arg, *mid_o.stride()[:3], *mid_lse.stride()[:2],
            *out.stride(), LORA_RANK=lora_rank, NUM_SPLITS=num_splits,
            HAS_ROWS=rows is not None, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
    return out


def _as_rows(latent: torch.Tensor) -> torch.Tensor:
    """latent [P, S, 1, D] or [P, S, D] -> the view [P, S, D]."""
    if latent.dim() == 4 and latent.shape[2] == 1:
        return latent[:, :, 0]
    if latent.dim() == 3:
        return latent
    raise ValueError(f"latent must be [P, S, 1, D] or [P, S, D], got {tuple(latent.shape)}")


def _check(q_nope, q_pe, latent, page_table, seq_lens, rows, out, num_splits) -> torch.Tensor:
    latent = _as_rows(latent)
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)}")
    if q_nope.shape[2] + q_pe.shape[2] != latent.shape[2]:
        raise ValueError(
            f"latent rows of {latent.shape[2]} != {q_nope.shape[2]} (nope) + {q_pe.shape[2]} (pe)"
        )
    if q_nope.dtype != q_pe.dtype or latent.dtype not in (q_nope.dtype, FP8):
        raise ValueError(
            f"q_nope, q_pe and latent (or an FP8 latent) dtypes differ: {q_nope.dtype} "
            f"{q_pe.dtype} {latent.dtype}"
        )
    if q_nope.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q_nope.dtype}")
    batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)}")
    if {page_table.dtype, seq_lens.dtype} - {torch.int32, torch.int64}:
        raise ValueError(f"page_table {page_table.dtype} / seq_lens {seq_lens.dtype} not int")
    if rows is not None and rows.shape != (batch,):
        raise ValueError(f"rows must be [{batch}], got {tuple(rows.shape)}")
    if rows is None and q_nope.shape[0] != batch:
        raise ValueError(f"q has {q_nope.shape[0]} rows for {batch} requests (pass rows)")
    if out is not None and (out.shape != q_nope.shape or out.dtype != q_nope.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be like q_nope")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    tensors = (q_pe, latent, page_table, seq_lens, rows, out)
    if any(t is not None and t.device != q_nope.device for t in tensors):
        raise ValueError("all tensors must be on one device")
    return latent
