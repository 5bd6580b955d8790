"""Paged decode attention (one query token per request), split along the sequence.

Stage 1, one program per (request, KV head, split): the G = H / Hkv query heads that
share the KV head are one [G, D] tile (padded to 16 rows for tl.dot), so each K/V page
is read once per group. It walks its split of the keys with an online softmax:

    keys of request b:  [ start ............................ seq_len )
                          | split 0 | split 1 | ... | split S-1 |     (each a multiple of BLOCK_N)
    start = max(0, seq_len - window) with a sliding window, else 0

and writes the normalised partial output and its log-sum-exp (base 2) per split.
Stage 2, one program per (request, query head), merges the splits. With one split,
stage 1 writes the output directly and stage 2 is skipped.
Math in float32; q and out share one dtype (bf16, fp16 or fp32), the caches q's or
float8_e4m3fn (kv_cache_dtype "fp8", scale 1.0: batchgen/kv_quant.py), upcast to q's
dtype as each block of keys and values is loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma
from batchgen.kv_quant import FP8

_LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, rows_ptr, page_table_ptr,
    seq_lens_ptr, scale_log2, window, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks,
    stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh,
    stride_od, stride_pt, stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q_ptrs = q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = page_table_ptr + b.to(tl.int64) * stride_pt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = (pos % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
        k = tl.load(
            k_cache_ptr + k_off[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        ).to(q.dtype)
        qk = mma(q, tl.trans(k), DOT_F32) * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        ).to(q.dtype)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_F32)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        o_ptrs = (
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # an empty split (lo >= hi) stores zeros and lse = -inf: weight 0 in stage 2
        nonempty = l_i > 0
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        b64 = b.to(tl.int64)
        mid = mid_o_ptr + b64 * stride_mo_b + split * stride_mo_s
        tl.store(mid + heads[:, None] * stride_mo_h + offs_d[None, :], o, mask=q_mask)
        tl.store(mid_lse_ptr + b64 * stride_ml_b + heads * stride_ml_h + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, rows_ptr, stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h, stride_ot, stride_oh, stride_od, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        mid_lse_ptr + b * stride_ml_b + h * stride_ml_h + offs_s, mask=s_mask, other=float("-inf")
    )
    w = tl.exp2(lse - tl.max(lse, 0))
    mid = mid_o_ptr + b * stride_mo_b + h * stride_mo_h
    o = tl.load(
        mid + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    acc = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    o_ptrs = out_ptr + row * stride_ot + h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the split kernel (BLOCK_N keys per step)."""

    block_n: int
    num_warps: int
    num_stages: int


GPU_TUNING = DecodeTuning(block_n=64, num_warps=4, num_stages=2)
GPU_TUNING_F32 = DecodeTuning(block_n=32, num_warps=4, num_stages=1)  # IEEE fp32 dots spill
CPU_TUNING = DecodeTuning(block_n=16, num_warps=4, num_stages=1)  # the interpreter


def default_tuning(q: torch.Tensor) -> DecodeTuning:
    if q.device.type != "cuda":
        return CPU_TUNING
    return GPU_TUNING_F32 if q.dtype == torch.float32 else GPU_TUNING


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits enough for ~4 (request, KV head, split) programs per SM, each split at least
    MIN_TOKENS_PER_SPLIT keys long; a power of two, so few kernel variants compile."""
    want = triton.next_power_of_2(triton.cdiv(4 * _num_sms(device), max(batch * num_kv_heads, 1)))
    most = min(MAX_SPLITS, max(1, max_seq_len // MIN_TOKENS_PER_SPLIT))
    return min(want, 1 << (most.bit_length() - 1))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:
    """Attention of one query per request over its paged K/V.

    q [B, H, D] (or, with `rows` [B], the packed [T, H, D] whose row rows[b] is request
    b's query); caches [P, page_size, Hkv, D]; page_table [B, >= ceil(seq_len/page_size)];
    seq_lens [B] (>= 1, the query's own key included). Writes out (like q; allocated when
    None) at the same rows and returns it. max_seq_len, a host int, only sizes the split
    count; without it the page table's width bounds it (no device sync). num_splits and
    tuning override the choices made from the batch shape and the device.
    """
    _check(q, k_cache, v_cache, page_table, seq_lens, rows, out)
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = page_table.shape[1] * page_size
    if sliding_window is not None:
        max_seq_len = min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, q.device)
    tuning = tuning or default_tuning(q)
    if num_splits > 1:
        mid_o = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any float32 tensors with the right rank do
        mid_o = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    rows_arg = rows if rows is not None else seq_lens
    block_d = max(16, triton.next_power_of_2(head_dim))
    has_rows, has_window = rows is not None, sliding_window is not None
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, rows_arg, page_table, seq_lens,
        scale * _LOG2E, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), page_table.stride(0),
        *mid_o.stride()[:3], *mid_lse.stride()[:2],
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        HAS_ROWS=has_rows, HAS_WINDOW=has_window, DOT_F32=dot_in_f32(q),
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=tuning.block_n, BLOCK_D=block_d,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            mid_o, mid_lse, out, rows_arg,
            *mid_o.stride()[:3], *mid_lse.stride()[:2], *out.stride(),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_ROWS=has_rows,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


def _check(q, k_cache, v_cache, page_table, seq_lens, rows, out) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [P, S, Hkv, D]: {k_cache.shape} / {v_cache.shape}")
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8):
        raise ValueError(
            f"k_cache, v_cache must both be q's dtype or FP8: {q.dtype} {k_cache.dtype} "
            f"{v_cache.dtype}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)}")
    if page_table.stride(1) != 1:
        raise ValueError("page_table rows must be contiguous")
    if rows is not None and rows.shape != (batch,):
        raise ValueError(f"rows must be [{batch}], got {tuple(rows.shape)}")
    if rows is None and q.shape[0] != batch:
        raise ValueError(f"q has {q.shape[0]} rows for {batch} requests (pass rows)")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be like q")
    tensors = [q, k_cache, v_cache, page_table, seq_lens] + [
        t for t in (rows, out) if t is not None
    ]
    if any(t.device != q.device for t in tensors):
        raise ValueError("all tensors must be on one device")
