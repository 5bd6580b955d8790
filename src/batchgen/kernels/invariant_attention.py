"""Batch-invariant paged attention, decode and prefill in one kernel (deterministic=True).

decode_attention splits a request's keys by the batch size and the GPU's multiprocessor
count, and prefill_attention tiles queries one head at a time, so a token's attention has
other bits alone than in a batch, and other bits decoded than prefilled. Here a row is one
(query, head) pair; request r's rows for KV head kvh are

    row i * GROUP + g  =  query i (packed row q_start + i, position prefix + i), head kvh * GROUP + g

and a tile is BLOCK_M consecutive rows of one (request, KV head); a program takes up to
SUBTILES consecutive tiles (a prefill's share one load of each block of keys, each tile
still its own products and softmax on the same code). It walks the keys in blocks of
BLOCK_N aligned to position 0, in position order, with an online softmax per tile, and
never splits them:

    keys:  | block 0 | block 1 | ... | block j (holds the row's position) | masked ... |

A block past a row's position (or before its sliding window) adds exactly nothing
(weight 0, scale 1), so a row's bits depend on its query, its sequence's keys and the
tuning alone: not on the batch, the tile it shares, the page ids or how the prompt was
chunked, and a decode row (one query: its G heads a tile) takes the same steps as the
same token prefilled. Launch grids depend on shapes only: CUDA-graph capturable.

Like prefill_attention: values may be narrower than keys, and queries and keys may come
in two parts (q_rope [T, H, R], k_rope [P, S, 1 or Hkv, R]: MLA's rope dimensions; MLA's
absorbed form is GROUP = H over one latent head, k the latent's first C values and v the
same). Math in float32, the caches q's dtype or float8_e4m3fn (upcast as loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.mma import dot_in_f32, mma
from batchgen.kernels.prefill_attention import rope_operands, tile_widths
from batchgen.kv_quant import FP8

_LOG2E = 1.4426950408889634


@triton.jit
def _rows(m0, kvh, q_start, q_len, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tile's rows from m0: (in range, head, packed row, query index)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    query = offs_m // GROUP
    heads = (kvh * GROUP + offs_m % GROUP).to(tl.int64)
    return offs_m < q_len * GROUP, heads, q_start + query.to(tl.int64), query


@triton.jit
def _load_q(
    q_ptr, qr_ptr, rows, heads, mask, stride_qt, stride_qh, stride_qd, stride_qrt,
    stride_qrh, stride_qrd, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """A tile's queries [BLOCK_M, BLOCK_D] and their rope part (q again without one)."""
    offs_d = tl.arange(0, BLOCK_D)
    at = rows[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(
        q_ptr + at + offs_d[None, :] * stride_qd,
        mask=mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    q_rope = q
    if ROPE_DIM > 0:
        offs_r = tl.arange(0, BLOCK_R)
        at_r = rows[:, None] * stride_qrt + heads[:, None] * stride_qrh
        q_rope = tl.load(
            qr_ptr + at_r + offs_r[None, :] * stride_qrd,
            mask=mask[:, None] & (offs_r < ROPE_DIM)[None, :],
            other=0.0,
        )
    return q, q_rope


@triton.jit
def _step(
    q, q_rope, q_pos, m_i, l_i, acc, k, k_rope, v, pos, scale_log2, window,
    ROPE_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """One tile's online softmax over one block of keys: the same code for every tile of
    every launch, so a row's bits never depend on the tiles beside it."""
    qk = mma(q, tl.trans(k), DOT_F32)
    if ROPE_DIM > 0:
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
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_F32)
    return m_new, l_i, acc


@triton.jit
def _store(
    out_ptr, acc, l_i, rows, heads, mask, stride_ot, stride_oh, stride_od,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    offs_dv = tl.arange(0, BLOCK_DV)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    at = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(
        at + offs_dv[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=mask[:, None] & (offs_dv < V_DIM)[None, :],
    )


@triton.jit
def _invariant_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qr_ptr, kr_ptr, q_start_ptr, q_len_ptr, seq_lens_ptr,
    page_table_ptr, scale_log2, window, stride_qt, stride_qh, stride_qd, stride_kp,
    stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_ot,
    stride_oh, stride_od, stride_pt, stride_qrt, stride_qrh, stride_qrd, stride_krp,
    stride_krs, stride_krh, stride_krd,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, SUBTILES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(0) * (BLOCK_M * SUBTILES)
    kvh = tl.program_id(1)
    r = tl.program_id(2)
    q_len = tl.load(q_len_ptr + r).to(tl.int32)
    if m0 >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    q_start = tl.load(q_start_ptr + r).to(tl.int64)
    prefix = seq_len - q_len
    # SUBTILES tiles of BLOCK_M rows share each block of keys, each its own online softmax
    mask0, heads0, rows0, query0 = _rows(m0, kvh, q_start, q_len, GROUP, BLOCK_M)
    q0, qr0 = _load_q(q_ptr, qr_ptr, rows0, heads0, mask0, stride_qt, stride_qh, stride_qd,
        stride_qrt, stride_qrh, stride_qrd, HEAD_DIM, ROPE_DIM, BLOCK_D, BLOCK_R)  # fmt: skip
    m_0 = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: an all-masked block is a no-op
    l_0 = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if SUBTILES >= 2:
        mask1, heads1, rows1, query1 = _rows(m0 + BLOCK_M, kvh, q_start, q_len, GROUP, BLOCK_M)
        q1, qr1 = _load_q(q_ptr, qr_ptr, rows1, heads1, mask1, stride_qt, stride_qh, stride_qd,
            stride_qrt, stride_qrh, stride_qrd, HEAD_DIM, ROPE_DIM, BLOCK_D, BLOCK_R)  # fmt: skip
        m_1 = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_1 = tl.zeros([BLOCK_M], tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if SUBTILES >= 4:
        m2 = m0 + 2 * BLOCK_M
        mask2, heads2, rows2, query2 = _rows(m2, kvh, q_start, q_len, GROUP, BLOCK_M)
        q2, qr2 = _load_q(q_ptr, qr_ptr, rows2, heads2, mask2, stride_qt, stride_qh, stride_qd,
            stride_qrt, stride_qrh, stride_qrd, HEAD_DIM, ROPE_DIM, BLOCK_D, BLOCK_R)  # fmt: skip
        m_2 = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_2 = tl.zeros([BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        m3 = m0 + 3 * BLOCK_M
        mask3, heads3, rows3, query3 = _rows(m3, kvh, q_start, q_len, GROUP, BLOCK_M)
        q3, qr3 = _load_q(q_ptr, qr_ptr, rows3, heads3, mask3, stride_qt, stride_qh, stride_qd,
            stride_qrt, stride_qrh, stride_qrd, HEAD_DIM, ROPE_DIM, BLOCK_D, BLOCK_R)  # fmt: skip
        m_3 = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_3 = tl.zeros([BLOCK_M], tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    last = tl.minimum((m0 + BLOCK_M * SUBTILES - 1) // GROUP, q_len - 1)
    hi = prefix + last + 1
    lo = 0
    if HAS_WINDOW:  # from the block of the first row's first key (aligned)
        lo = (tl.maximum(prefix + m0 // GROUP - window + 1, 0) // BLOCK_N) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < V_DIM
    table = page_table_ptr + r.to(tl.int64) * stride_pt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = (pos % PAGE_SIZE).to(tl.int64)
        k_at = page * stride_kp + in_page * stride_ks + kvh * stride_kh
        k = tl.load(
            k_ptr + k_at[:, None] + offs_d[None, :] * stride_kd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(q0.dtype)
        k_rope = k
        if ROPE_DIM > 0:
            offs_r = tl.arange(0, BLOCK_R)
            kr_at = page * stride_krp + in_page * stride_krs + kvh * stride_krh
            k_rope = tl.load(
                kr_ptr + kr_at[:, None] + offs_r[None, :] * stride_krd,
                mask=n_mask[:, None] & (offs_r < ROPE_DIM)[None, :],
                other=0.0,
            ).to(q0.dtype)
        v_at = page * stride_vp + in_page * stride_vs + kvh * stride_vh
        v = tl.load(
            v_ptr + v_at[:, None] + offs_dv[None, :] * stride_vd,
            mask=n_mask[:, None] & dv_mask[None, :],
            other=0.0,
        ).to(q0.dtype)
        m_0, l_0, acc0 = _step(q0, qr0, prefix + query0, m_0, l_0, acc0, k, k_rope, v, pos,
            scale_log2, window, ROPE_DIM, HAS_WINDOW, DOT_F32)  # fmt: skip
        if SUBTILES >= 2:
            m_1, l_1, acc1 = _step(q1, qr1, prefix + query1, m_1, l_1, acc1, k, k_rope, v, pos,
                scale_log2, window, ROPE_DIM, HAS_WINDOW, DOT_F32)  # fmt: skip
        if SUBTILES >= 4:
            m_2, l_2, acc2 = _step(q2, qr2, prefix + query2, m_2, l_2, acc2, k, k_rope, v, pos,
                scale_log2, window, ROPE_DIM, HAS_WINDOW, DOT_F32)  # fmt: skip
            m_3, l_3, acc3 = _step(q3, qr3, prefix + query3, m_3, l_3, acc3, k, k_rope, v, pos,
                scale_log2, window, ROPE_DIM, HAS_WINDOW, DOT_F32)  # fmt: skip

    _store(
        out_ptr, acc0, l_0, rows0, heads0, mask0, stride_ot, stride_oh, stride_od, V_DIM, BLOCK_DV
    )
    if SUBTILES >= 2:
        _store(out_ptr, acc1, l_1, rows1, heads1, mask1, stride_ot, stride_oh, stride_od, V_DIM,
            BLOCK_DV)  # fmt: skip
    if SUBTILES >= 4:
        _store(out_ptr, acc2, l_2, rows2, heads2, mask2, stride_ot, stride_oh, stride_od, V_DIM,
            BLOCK_DV)  # fmt: skip
        _store(out_ptr, acc3, l_3, rows3, heads3, mask3, stride_ot, stride_oh, stride_od, V_DIM,
            BLOCK_DV)  # fmt: skip


@dataclass(frozen=True)
class InvariantAttentionTuning:
    """BLOCK_M rows ((query, head) pairs) a tile, BLOCK_N keys a step, up to `subtiles`
    tiles (1, 2 or 4) a program sharing each block of keys. A function of the device,
    dtype and head widths only, never of the batch: decode and prefill of one model run
    the same tile code (the subtiles a program takes leave every tile's bits alone, so a
    launch takes as many as its rows fill)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    subtiles: int = 1


GPU_TUNING = InvariantAttentionTuning(block_m=16, block_n=64, num_warps=4, num_stages=2, subtiles=4)
# IEEE fp32 dots, and heads wider than 256 (MLA's 512 + 64 latent), take half the keys
GPU_TUNING_NARROW = InvariantAttentionTuning(
    block_m=16, block_n=32, num_warps=4, num_stages=1, subtiles=2
)
CPU_TUNING = InvariantAttentionTuning(block_m=16, block_n=16, num_warps=4, num_stages=1, subtiles=2)


def default_tuning(q: torch.Tensor, width: int) -> InvariantAttentionTuning:
    """The launch for q's device and dtype and a key `width` (both parts)."""
    if q.device.type != "cuda":
        return CPU_TUNING
    if q.dtype == torch.float32 or width > 256:
        return GPU_TUNING_NARROW
    return GPU_TUNING


def invariant_attention(
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
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
    tuning: InvariantAttentionTuning | None = None,
) -> torch.Tensor:
    """Causal attention of each request's packed query rows over its paged K/V, every
    row's bits independent of the batch (module docstring). Arguments as
    prefill_attention's: q [T, H, D]; k_cache [P, page_size, Hkv, D], v_cache [P,
    page_size, Hkv, Dv] (strided views allowed); q_start, q_len, seq_lens [R]; page_table
    [R, >= ceil(seq_len / page_size)]; max_q_len >= every q_len (a host int: it sizes the
    grid); q_rope [T, H, R] with k_rope [P, page_size, 1 or Hkv, R], or neither. Writes
    the requests' rows of out ([T, H, Dv], q's dtype unless given) and returns it."""
    _check(q, k_cache, v_cache, q_start, q_len, seq_lens, page_table, q_rope, k_rope)
    if out is None:
        out = q.new_empty(*q.shape[:2], v_cache.shape[3])
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_q_len == 0:
        return out
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_heads, v_dim = q.shape[1], v_cache.shape[3]
    group = num_heads // num_kv_heads
    rope_dim = 0 if q_rope is None else q_rope.shape[2]
    tuning = tuning or default_tuning(q, head_dim + rope_dim)
    if tuning.subtiles not in (1, 2, 4):
        raise ValueError(f"subtiles must be 1, 2 or 4, got {tuning.subtiles}")
    tiles = triton.cdiv(max_q_len * group, tuning.block_m)
    subtiles = min(tuning.subtiles, triton.next_power_of_2(tiles))  # no idle tile a program
    grid = (triton.cdiv(tiles, subtiles), num_kv_heads, num_reqs)
    q_rope, k_rope, *rope_strides = rope_operands(q, k_cache, q_rope, k_rope)
    _invariant_kernel[grid](
        q, k_cache, v_cache, out, q_rope, k_rope, q_start, q_len, seq_lens, page_table,
        scale * _LOG2E, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), page_table.stride(0),
        *rope_strides,
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, ROPE_DIM=rope_dim, PAGE_SIZE=page_size,
        HAS_WINDOW=sliding_window is not None, DOT_F32=dot_in_f32(q),
        BLOCK_M=tuning.block_m, SUBTILES=subtiles, BLOCK_N=tuning.block_n,
        **tile_widths(head_dim, v_dim, rope_dim),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    return out


def invariant_decode(
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
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
    tuning: InvariantAttentionTuning | None = None,
) -> torch.Tensor:
    """One query per request (decode_attention's arguments: q [B, H, D], or the packed
    [T, H, D] with `rows` [B] naming each request's row), as invariant_attention with
    q_len 1: the same program and steps as the token prefilled."""
    batch = seq_lens.shape[0]
    if rows is None:
        if q.shape[0] != batch:
            raise ValueError(f"q has {q.shape[0]} rows for {batch} requests (pass rows)")
        rows = torch.arange(batch, device=q.device)
    ones = torch.ones_like(seq_lens)
    return invariant_attention(
        q, k_cache, v_cache, rows, ones, seq_lens, page_table, 1, scale, sliding_window,
        out=out, q_rope=q_rope, k_rope=k_rope, tuning=tuning,
    )  # fmt: skip


def _check(q, k_cache, v_cache, q_start, q_len, seq_lens, page_table, q_rope, k_rope) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"caches must be [P, S, Hkv, D] and [P, S, Hkv, Dv]: {k_cache.shape} / {v_cache.shape}"
        )
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8):
        raise ValueError(f"caches must be q's dtype or FP8: {q.dtype} {k_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    num_reqs = seq_lens.shape[0]
    for name, t in (("q_start", q_start), ("q_len", q_len), ("seq_lens", seq_lens)):
        if t.shape != (num_reqs,):
            raise ValueError(f"{name} must be [{num_reqs}], got {tuple(t.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != num_reqs or page_table.stride(1) != 1:
        raise ValueError(f"page_table must be [{num_reqs}, pages] with contiguous rows")
    if (q_rope is None) != (k_rope is None):
        raise ValueError("give both q_rope and k_rope or neither")
    if q_rope is not None and (
        q_rope.shape[:2] != q.shape[:2]
        or k_rope.shape[:2] != k_cache.shape[:2]
        or k_rope.shape[2] not in (1, k_cache.shape[2])
        or k_rope.shape[3] != q_rope.shape[2]
    ):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} / k_rope {tuple(k_rope.shape)} misfit")
    tensors = [q, k_cache, v_cache, q_start, q_len, seq_lens, page_table]
    if any(t.device != q.device for t in tensors):
        raise ValueError("all tensors must be on one device")
