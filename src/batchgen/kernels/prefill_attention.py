"""Prefill / extend attention over paged K/V with a cached prefix, variable-length batch.

One program per (query head, block of BLOCK_M queries, request). Request r's queries are
packed rows [q_start, q_start + q_len) and sit at the end of its sequence:

    keys (all in the cache):  [0 ........ prefix )[ prefix ........ seq_len )
    queries:                                       [ q 0 ........ q q_len-1 )
    prefix = seq_len - q_len; query i is at position prefix + i and sees keys
    k <= prefix + i (and k > prefix + i - window with a sliding window)

A program walks the keys [lo, hi) its block can see (hi = one past its last query's
position, lo from the window) in BLOCK_N steps with an online softmax, reading each key
through the page table. Math in float32; q and out share one dtype, the caches q's or
float8_e4m3fn (kv_cache_dtype "fp8", scale 1.0: batchgen/kv_quant.py), upcast to q's
dtype as each block of keys and values is loaded. Values may
be narrower than keys (MLA's decompressed heads: V 128 wide): out has V's width.

Queries and keys may come in two parts (MLA: 128 "nope" dimensions, then 64 rope ones):
q [T, H, D] with q_rope [T, H, R], keys [P, S, Hkv, D] with k_rope [P, S, 1 or Hkv, R]
(one rope head shared by every head, as MLA's k_pe is); a score is q . k + q_rope .
k_rope. Neither part is copied into a joint tensor, and each is padded to its own power
of two (128 + 64, not 192 -> 256).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma
from batchgen.kv_quant import FP8

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, q_start_ptr, q_len_ptr, seq_lens_ptr,
    page_table_ptr, scale_log2, window, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks,
    stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh,
    stride_od, stride_pt, qr_ptr, kr_ptr, stride_qrt, stride_qrh, stride_qrd, stride_krp,
    stride_krs, stride_krh, stride_krd, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
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
    if ROPE_DIM > 0:  # the queries' second part (a static branch: ROPE_DIM is constexpr)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < ROPE_DIM
        qr_ptrs = qr_ptr + q_rows[:, None] * stride_qrt + h * stride_qrh
        q_rope = tl.load(
            qr_ptrs + offs_r[None, :] * stride_qrd,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
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
        ).to(q.dtype)
        qk = mma(q, tl.trans(k), DOT_F32)
        if ROPE_DIM > 0:
            kr_off = page * stride_krp + in_page * stride_krs + kvh * stride_krh
            k_rope = tl.load(
                kr_ptr + kr_off[:, None] + offs_r[None, :] * stride_krd,
                mask=n_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            qk += mma(q_rope, tl.trans(k_rope), DOT_F32)
        qk = qk * scale_log2
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
        ).to(q.dtype)
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
# Key or value heads padded to a power of two (widths like 40 and 24). Triton 3.6 on the
# H200 built the 8-warp program for keys 40 wide and values 24 wide so that its softmax
# row sum read shared memory out of range (compute-sanitizer; a fault from the second
# launch on); with 4 warps the same shapes run clean.
GPU_TUNING_PADDED = PrefillTuning(block_m=128, block_n=64, num_warps=4, num_stages=2)
CPU_TUNING = PrefillTuning(block_m=16, block_n=16, num_warps=4, num_stages=1)  # the interpreter


def default_tuning(q: torch.Tensor, v_dim: int | None = None) -> PrefillTuning:
    """The launch for q's device and dtype; v_dim (values' width, default q's) picks the
    4-warp launch when either width is not a power of two."""
    if q.device.type != "cuda":
        return CPU_TUNING
    if q.dtype == torch.float32:
        return GPU_TUNING_F32
    widths = (q.shape[-1], q.shape[-1] if v_dim is None else v_dim)
    if any(w & (w - 1) for w in widths):
        return GPU_TUNING_PADDED
    return GPU_TUNING


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
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's packed query rows over its paged K/V.

    q [T, H, D] packed; k_cache [P, page_size, Hkv, D] and v_cache [P, page_size, Hkv,
    Dv] already holding every query's own K/V; q_start, q_len, seq_lens [R]; page_table
    [R, >= ceil(seq_len/page_size)]; max_q_len >= every q_len (a host int: it sizes the
    grid). Writes the rows of out ([T, H, Dv] in q's dtype; allocated when None) that
    belong to the requests and returns out. tuning overrides the launch parameters picked
    for the device. q_rope [T, H, R] and k_rope [P, page_size, 1 or Hkv, R], both or
    neither: the second part of every query and key (see the module docstring). Any of
    the tensors may be a strided view (rows of a wider projection).
    """
    _check(q, k_cache, v_cache, q_start, q_len, seq_lens, page_table, out)
    _check_rope(q, k_cache, q_rope, k_rope)
    if out is None:
        out = q.new_empty(*q.shape[:2], v_cache.shape[3])
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_q_len == 0:
        return out
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_heads, v_dim = q.shape[1], v_cache.shape[3]
    tuning = tuning or default_tuning(q, v_dim)
    grid = (num_heads, triton.cdiv(max_q_len, tuning.block_m), num_reqs)
    rope_dim = 0 if q_rope is None else q_rope.shape[2]
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, q_start, q_len, seq_lens, page_table,
        scale * _LOG2E, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), page_table.stride(0),
        *rope_operands(q, k_cache, q_rope, k_rope),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, V_DIM=v_dim, ROPE_DIM=rope_dim,
        PAGE_SIZE=page_size, HAS_WINDOW=sliding_window is not None, DOT_F32=dot_in_f32(q),
        BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n,
        **tile_widths(head_dim, v_dim, rope_dim),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out


def tile_widths(head_dim: int, v_dim: int, rope_dim: int) -> dict[str, int]:
    """The tile widths of a key's first part, a value and a key's second part: each
    width padded to a power of two, at least 16 (tl.dot's least)."""
    return {
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(v_dim)),
        "BLOCK_R": max(16, triton.next_power_of_2(max(rope_dim, 1))),
    }


def rope_operands(q, k_cache, q_rope, k_rope) -> tuple:
    """The second part's kernel arguments: q_rope, k_rope and their seven strides. With
    no second part q and k_cache stand in (never read) with zero strides; a k_rope of
    one head is read by every KV head (its head stride 0)."""
    if q_rope is None:
        return (q, k_cache, *(0,) * 7)
    kr_strides = list(k_rope.stride())
    if k_rope.shape[2] == 1:
        kr_strides[2] = 0
    return (q_rope, k_rope, *q_rope.stride(), *kr_strides)


def _check_rope(q, k_cache, q_rope, k_rope) -> None:
    if (q_rope is None) != (k_rope is None):
        raise ValueError("give both q_rope and k_rope or neither")
    if q_rope is None:
        return
    if q_rope.dim() != 3 or q_rope.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q_rope {tuple(q_rope.shape)} must be [T, H, R] beside q {tuple(q.shape)}"
        )
    heads = k_rope.shape[2] if k_rope.dim() == 4 else -1
    if k_rope.shape[:2] != k_cache.shape[:2] or heads not in (1, k_cache.shape[2]):
        raise ValueError(
            f"k_rope {tuple(k_rope.shape)} must be [P, S, 1 or Hkv, R] beside keys "
            f"{tuple(k_cache.shape)}"
        )
    if k_rope.shape[3] != q_rope.shape[2]:
        raise ValueError(f"q_rope and k_rope widths differ: {q_rope.shape[2]} {k_rope.shape[3]}")
    if q_rope.dtype != q.dtype or k_rope.dtype != q.dtype:
        raise ValueError(f"q_rope, k_rope dtypes must be q's {q.dtype}")
    if q_rope.device != q.device or k_rope.device != q.device:
        raise ValueError("all tensors must be on one device")


def _check(q, k_cache, v_cache, q_start, q_len, seq_lens, page_table, out) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"caches must be [P, S, Hkv, D] and [P, S, Hkv, Dv]: {k_cache.shape} / {v_cache.shape}"
        )
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8):
        raise ValueError(
            f"k_cache, v_cache must both be q's dtype or FP8: {q.dtype} {k_cache.dtype} "
            f"{v_cache.dtype}"
        )
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
