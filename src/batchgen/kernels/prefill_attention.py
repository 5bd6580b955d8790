"""Prefill / extend attention over paged K/V with a cached prefix, variable-length batch.

One program per (query head, block of BLOCK_M queries, request). Request r's queries are
packed rows [q_start, q_start + q_len) and sit at the end of its sequence:

    keys (all in the cache):  [0 ........ prefix )[ prefix ........ seq_len )
    queries:                                       [ q 0 ........ q q_len-1 )
    prefix = seq_len - q_len; query i is at position prefix + i and sees keys
    k <= prefix + i (and k > prefix + i - window with a sliding window)

A program walks the keys [lo, hi) its block can see (hi = one past its last query's
position, lo from the window) in BLOCK_N steps with an online softmax, reading each key
through the page table. Math in float32; q, caches and out share one dtype. Values may
be narrower than keys (MLA's decompressed heads: K 192 wide, V 128): out has V's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, q_start_ptr, q_len_ptr, seq_lens_ptr,
    page_table_ptr, scale_log2, window, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks,
    stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh,
    stride_od, stride_pt, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)  # fastest: the heads sharing a KV head run together (L2 reuse)
    m0 = tl.program_id(1) * BLOCK_M
    r = tl.program_id(2)
    q_len = tl.load(q_len_ptr + r).to(tl.int32)
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    q_start = tl.load(q_start_ptr + r).to(tl.int64)
    prefix = seq_len - q_len
    kvh = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < V_DIM
    q_mask = m_mask[:, None] & d_mask[None, :]
    q_rows = q_start + offs_m.to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    q_pos = prefix + offs_m

    hi = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    # finite start: a row whose keys in one block are all masked stays NaN-free
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table = page_table_ptr + r.to(tl.int64) * stride_pt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = (pos % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
        k = tl.load(
            k_cache_ptr + k_off[:, None] + offs_d[None, :] * stride_kd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        qk = mma(q, tl.trans(k), DOT_F32) * scale_log2
        allowed = pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_dv[None, :] * stride_vd,
            mask=n_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_F32)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])


@dataclass(frozen=True)
class PrefillTuning:
    """Launch parameters: BLOCK_M queries per program, BLOCK_N keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


GPU_TUNING = PrefillTuning(block_m=128, block_n=64, num_warps=8, num_stages=2)
GPU_TUNING_F32 = PrefillTuning(block_m=64, block_n=32, num_warps=4, num_stages=1)  # IEEE dots
CPU_TUNING = PrefillTuning(block_m=16, block_n=16, num_warps=4, num_stages=1)  # the interpreter


def default_tuning(q: torch.Tensor) -> PrefillTuning:
    if q.device.type != "cuda":
        return CPU_TUNING
    return GPU_TUNING_F32 if q.dtype == torch.float32 else GPU_TUNING


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: PrefillTuning | None = None,
) -> torch.Tensor:
    """Causal attention of each request's packed query rows over its paged K/V.

    q [T, H, D] packed; k_cache [P, page_size, Hkv, D] and v_cache [P, page_size, Hkv,
    Dv] already holding every query's own K/V; q_start, q_len, seq_lens [R]; page_table
    [R, >= ceil(seq_len/page_size)]; max_q_len >= every q_len (a host int: it sizes the
    grid). Writes the rows of out ([T, H, Dv] in q's dtype; allocated when None) that
    belong to the requests and returns out. tuning overrides the launch parameters picked
    for the device.
    """
    _check(q, k_cache, v_cache, q_start, q_len, seq_lens, page_table, out)
    if out is None:
        out = q.new_empty(*q.shape[:2], v_cache.shape[3])
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_q_len == 0:
        return out
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_heads, v_dim = q.shape[1], v_cache.shape[3]
    tuning = tuning or default_tuning(q)
    grid = (num_heads, triton.cdiv(max_q_len, tuning.block_m), num_reqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, q_start, q_len, seq_lens, page_table,
        scale * _LOG2E, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), page_table.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, V_DIM=v_dim, PAGE_SIZE=page_size,
        HAS_WINDOW=sliding_window is not None, DOT_F32=dot_in_f32(q),
        BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out


def _check(q, k_cache, v_cache, q_start, q_len, seq_lens, page_table, out) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"caches must be [P, S, Hkv, D] and [P, S, Hkv, Dv]: {k_cache.shape} / {v_cache.shape}"
        )
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype} {k_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    num_reqs = seq_lens.shape[0]
    for name, t in (("q_start", q_start), ("q_len", q_len), ("seq_lens", seq_lens)):
        if t.shape != (num_reqs,):
            raise ValueError(f"{name} must be [{num_reqs}], got {tuple(t.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != num_reqs or page_table.stride(1) != 1:
        raise ValueError(f"page_table must be [{num_reqs}, pages] with contiguous rows")
    out_shape = (*q.shape[:2], v_cache.shape[3])
    if out is not None and (tuple(out.shape) != out_shape or out.dtype != q.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be {out_shape} {q.dtype}")
    tensors = [q, k_cache, v_cache, q_start, q_len, seq_lens, page_table]
    if any(t.device != q.device for t in tensors + ([out] if out is not None else [])):
        raise ValueError("all tensors must be on one device")


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> float32 [T, H, Dv] (rows of no request are zero), in plain torch."""
    num_heads = q.shape[1]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = q.new_zeros(*q.shape[:2], v_cache.shape[3], dtype=torch.float32)
    specs = zip(q_start.tolist(), q_len.tolist(), seq_lens.tolist())
    for r, (start, n, seq_len) in enumerate(specs):
        pages = page_table[r, : math.ceil(seq_len / page_size)]
        k = k_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
