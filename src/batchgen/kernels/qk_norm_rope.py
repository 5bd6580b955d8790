"""Per-head RMSNorm (optional, Qwen3) and rotary embedding of q and k, read from the fused
qkv projection: one Triton program per (token, q or k).

    qkv row:  [ q head 0 | ... | q head H-1 | k head 0 | ... | k head Hkv-1 | v ... ]
                each head D wide; v is not read

Per head x [D] of token t at position p = positions[t]:

    if norm weights:  h = float32(x); h = h * rsqrt(mean(h * h) + eps)
                      x = weight * h.to(dtype)            (float32 product, rounded once)
    rope (neox):      out = x * cos[p] + rotate_half(x) * sin[p],
                      rotate_half(x) = cat(-x[D/2:], x[:D/2])

The norm rounds as layers/norm.py does; the rope is computed in float32 from the float32
tables and rounded once (the op-by-op torch path in layers/rotary.py rounds each op to the
dtype, so bf16 results differ from it by an ulp here and there).

`qk_norm_rope_store` is the same rope with the K/V write of kernels/store_kv.py in the
same launch: one program per (token, q or k or v) writes q to its output and the new k
(rounded to qkv's dtype first, as the two kernels round it) and v (read from the qkv
row) into the paged caches at the token's slot; a negative slot writes no K/V. An FP8
cache gets store_kv's saturated e4m3 rounding (`e4m3_grid`), so the pages hold the bytes
qk_norm_rope followed by store_kv writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import rne_by_hand, to_dtype
from batchgen.kernels.store_kv import e4m3_grid
from batchgen.kv_quant import FP8_MAX, is_fp8

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rope_tables(pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_table, t, HEAD_DIM: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Token t's cos/sin halves [1, BLOCK_HALF] each, float32."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    cos_row = cos_ptr + pos * stride_table
    sin_row = sin_ptr + pos * stride_table
    cos1 = tl.load(cos_row + d, mask=dmask, other=0.0)
    cos2 = tl.load(cos_row + HALF + d, mask=dmask, other=0.0)
    sin1 = tl.load(sin_row + d, mask=dmask, other=0.0)
    sin2 = tl.load(sin_row + HALF + d, mask=dmask, other=0.0)
    return cos1, cos2, sin1, sin2


@triton.jit
def _norm_rope_values(
    src, w_ptr, cos1, cos2, sin1, sin2, eps, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """NUM_HEADS heads of HEAD_DIM contiguous values at src, normalised and rotated: the
    two halves [BLOCK_H, BLOCK_HALF] rounded to src's dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = src.dtype.element_ty
    head = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (head < NUM_HEADS) & (d < HALF)
    x1 = tl.load(src + head * HEAD_DIM + d, mask=mask, other=0.0)
    x2 = tl.load(src + head * HEAD_DIM + HALF + d, mask=mask, other=0.0)
    if HAS_NORM:
        h1, h2 = x1.to(tl.float32), x2.to(tl.float32)
        mean_sq = (tl.sum(h1 * h1, axis=1) + tl.sum(h2 * h2, axis=1)) * (1.0 / HEAD_DIM)
        rstd = tl.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        n1 = to_dtype(h1 * rstd, dtype, RNE_BY_HAND).to(tl.float32)
        n2 = to_dtype(h2 * rstd, dtype, RNE_BY_HAND).to(tl.float32)
        x1 = to_dtype(w1 * n1, dtype, RNE_BY_HAND)
        x2 = to_dtype(w2 * n2, dtype, RNE_BY_HAND)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    return to_dtype(out1, dtype, RNE_BY_HAND), to_dtype(out2, dtype, RNE_BY_HAND)


@triton.jit
def _norm_rope_heads(
    src, dst, stride_dst_h, w_ptr, cos1, cos2, sin1, sin2, eps, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """NUM_HEADS heads of HEAD_DIM contiguous values at src -> dst (head stride given)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    out1, out2 = _norm_rope_values(
        src, w_ptr, cos1, cos2, sin1, sin2, eps, NUM_HEADS, HEAD_DIM, HAS_NORM, BLOCK_H,
        BLOCK_HALF, RNE_BY_HAND,
    )  # fmt: skip
    head = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (head < NUM_HEADS) & (d < HALF)
    out = dst + head * stride_dst_h + d
    tl.store(out, out1, mask=mask)
    tl.store(out + HALF, out2, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, stride_qkv, stride_pos,
    stride_table, stride_qt, stride_qh, stride_kt, stride_kh, eps, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2 = _rope_tables(
        pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_table, t, HEAD_DIM, BLOCK_HALF
    )
    row = qkv_ptr + t * stride_qkv
    if tl.program_id(1) == 0:
        _norm_rope_heads(
            row, q_ptr + t * stride_qt, stride_qh, qw_ptr, cos1, cos2, sin1, sin2, eps,
            NUM_HEADS, HEAD_DIM, HAS_NORM, BLOCK_HQ, BLOCK_HALF, RNE_BY_HAND,
        )  # fmt: skip
    else:
        _norm_rope_heads(
            row + NUM_HEADS * HEAD_DIM, k_ptr + t * stride_kt, stride_kh, kw_ptr, cos1, cos2,
            sin1, sin2, eps, NUM_KV_HEADS, HEAD_DIM, HAS_NORM, BLOCK_HK, BLOCK_HALF, RNE_BY_HAND,
        )  # fmt: skip


def rope_width(cos: torch.Tensor, sin: torch.Tensor) -> int:
    """The width D of float32 rope tables cos/sin [P, D] (D even, one layout, contiguous
    rows), or ValueError naming what is wrong."""
    if cos.dim() != 2 or cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin must be one [P, D] layout: {list(cos.shape)} {list(sin.shape)}")
    if cos.shape[1] % 2 or cos.stride(1) != 1 or {cos.dtype, sin.dtype} != {torch.float32}:
        raise ValueError(
            f"cos/sin must be float32 [P, D] (D even) with contiguous rows: "
            f"{list(cos.shape)} {cos.dtype} {sin.dtype} strides {cos.stride()}"
        )
    return cos.shape[1]


def _check_out(name: str, t: torch.Tensor, shape: tuple[int, int, int], dtype, device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or t.stride(2) != 1:
        raise ValueError(
            f"{name} must be {list(shape)} {dtype} on {device}, contiguous within a head: "
            f"{list(t.shape)} {t.dtype} {t.device} strides {t.stride()}"
        )


def _check_inputs(qkv, positions, cos, sin, num_heads, num_kv_heads, q_weight, k_weight) -> int:
    """The head width D, or ValueError naming what does not fit (both kernels' inputs)."""
    if qkv.dim() != 2 or qkv.dtype not in _DTYPES or (qkv.shape[1] > 1 and qkv.stride(1) != 1):
        raise ValueError(f"qkv must be [T, (H + 2 Hkv) D] with contiguous rows: {qkv.shape}")
    num_tokens = qkv.shape[0]
    head_dim = rope_width(cos, sin)
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv width {qkv.shape[1]} != ({num_heads} + 2 * {num_kv_heads}) * {head_dim}"
        )
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{num_tokens}] int32/int64: {positions.shape}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    for w in (q_weight, k_weight):
        if w is not None and (w.shape != (head_dim,) or w.dtype != qkv.dtype or w.stride(0) != 1):
            raise ValueError(f"norm weights must be contiguous [{head_dim}] {qkv.dtype}")
    devices = {qkv.device, positions.device, cos.device, sin.device}
    devices |= {w.device for w in (q_weight, k_weight) if w is not None}
    if len(devices) != 1:
        raise ValueError("qkv, positions, cos/sin and the norm weights must be on one device")
    return head_dim


def _new_q(qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    return torch.empty((qkv.shape[0], num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] normalised (when weights are given) and rotated.

    qkv [T, (H + 2 Hkv) D]: the fused projection, rows may be strided (e.g. a view),
    contiguous within a row; it is only read. positions [T] (int32/int64) index the float32
    cos/sin tables [max_positions, D] (neox: both halves filled); positions are not
    bounds-checked (no host sync). q_weight/k_weight [D] in qkv's dtype, both or neither.
    Results go to new contiguous tensors, or to `out` = (q, k) (strided heads allowed).
    """
    head_dim = _check_inputs(qkv, positions, cos, sin, num_heads, num_kv_heads, q_weight, k_weight)
    num_tokens = qkv.shape[0]
    if out is None:
        q, k = _new_q(qkv, num_heads, head_dim), _new_q(qkv, num_kv_heads, head_dim)
    else:
        q, k = out
    _check_out("q", q, (num_tokens, num_heads, head_dim), qkv.dtype, qkv.device)
    _check_out("k", k, (num_tokens, num_kv_heads, head_dim), qkv.dtype, qkv.device)
    if num_tokens > 0:
        has_norm = q_weight is not None
        _qk_norm_rope_kernel[(num_tokens, 2)](
            qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
            q, k, qkv.stride(0), positions.stride(0), cos.stride(0), q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim, HAS_NORM=has_norm,
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2), RNE_BY_HAND=rne_by_hand(qkv),
            num_warps=4,
        )  # fmt: skip
    return q, k


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, stride_qkv, stride_pos, stride_table, stride_qt, stride_qh, stride_kc_page,
    stride_kc_off, stride_kc_h, stride_kc_d, stride_vc_page, stride_vc_off, stride_vc_h,
    stride_vc_d, eps, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Program (t, 0): q's heads; (t, 1): k's heads into k_cache; (t, 2): v into v_cache."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row = qkv_ptr + t * stride_qkv
    if part == 0:
        cos1, cos2, sin1, sin2 = _rope_tables(
            pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_table, t, HEAD_DIM, BLOCK_HALF
        )
        _norm_rope_heads(
            row, q_ptr + t * stride_qt, stride_qh, qw_ptr, cos1, cos2, sin1, sin2, eps,
            NUM_HEADS, HEAD_DIM, HAS_NORM, BLOCK_HQ, BLOCK_HALF, RNE_BY_HAND,
        )  # fmt: skip
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # a negative slot: a padding row, no K/V written
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            # each part in a function of its own: compiled, a name assigned in both
            # branches of an `if` must have one type in both (the interpreter never asks)
            if part == 1:
                _store_k_heads(
                    row, pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_table, kw_ptr,
                    k_cache_ptr + page * stride_kc_page + off * stride_kc_off, stride_kc_h,
                    stride_kc_d, t, eps, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM, CLAMP,
                    BLOCK_HK, BLOCK_HALF, RNE_BY_HAND,
                )  # fmt: skip
            else:
                _store_v_heads(
                    row, v_cache_ptr + page * stride_vc_page + off * stride_vc_off,
                    stride_vc_h, stride_vc_d, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, CLAMP,
                    BLOCK_HK, BLOCK_D,
                )  # fmt: skip


@triton.jit
def _store_k_heads(
    row, pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_table, kw_ptr, kc, stride_kc_h,
    stride_kc_d, t, eps, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Token t's k heads from its qkv row, normalised and rotated, into its cache slot kc."""
    HALF: tl.constexpr = HEAD_DIM // 2
    cos1, cos2, sin1, sin2 = _rope_tables(
        pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_table, t, HEAD_DIM, BLOCK_HALF
    )
    k1, k2 = _norm_rope_values(
        row + NUM_HEADS * HEAD_DIM, kw_ptr, cos1, cos2, sin1, sin2, eps,
        NUM_KV_HEADS, HEAD_DIM, HAS_NORM, BLOCK_HK, BLOCK_HALF, RNE_BY_HAND,
    )  # fmt: skip
    if CLAMP > 0:  # an FP8 cache: saturated and rounded, the cast below exact
        k1, k2 = e4m3_grid(k1, CLAMP), e4m3_grid(k2, CLAMP)
    h = tl.arange(0, BLOCK_HK)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HALF)
    kc = kc + h * stride_kc_h
    dtype = kc.dtype.element_ty
    tl.store(kc + d * stride_kc_d, k1.to(dtype), mask=mask)
    tl.store(kc + (HALF + d) * stride_kc_d, k2.to(dtype), mask=mask)


@triton.jit
def _store_v_heads(
    row, vc, stride_vc_h, stride_vc_d, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, CLAMP: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A token's v heads, read from its qkv row as they are, into its cache slot vc."""
    h = tl.arange(0, BLOCK_HK)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + h) * HEAD_DIM + d, mask=mask)
    if CLAMP > 0:
        v = e4m3_grid(v, CLAMP)
    dtype = vc.dtype.element_ty
    tl.store(vc + h * stride_vc_h + d * stride_vc_d, v.to(dtype), mask=mask)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qk_norm_rope and store_kv in one launch: returns q [T, H, D] (new, or `out` with
    strided heads allowed) and writes the rotated k and qkv's v rows into the [pages,
    page_size, Hkv, D] caches (any strides, e.g. one layer of a pool; any float dtype or
    FP8 e4m3) at slot_mapping [T] (int32/int64; negative: skipped). The q and the cache
    bytes are those qk_norm_rope then store_kv give. No host synchronisation and no
    allocation but q's: CUDA-graph capturable."""
    head_dim = _check_inputs(qkv, positions, cos, sin, num_heads, num_kv_heads, q_weight, k_weight)
    num_tokens = qkv.shape[0]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"caches must be [P, S, Hkv, D]: {k_cache.shape} / {v_cache.shape}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold {num_kv_heads} x {head_dim}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64")
    if not (qkv.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("qkv, caches and slot_mapping must be on one device")
    q = _new_q(qkv, num_heads, head_dim) if out is None else out
    _check_out("q", q, (num_tokens, num_heads, head_dim), qkv.dtype, qkv.device)
    if num_tokens > 0:
        has_norm = q_weight is not None
        _qk_norm_rope_store_kernel[(num_tokens, 3)](
            qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
            q, k_cache, v_cache, slot_mapping, qkv.stride(0), positions.stride(0),
            cos.stride(0), q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            PAGE_SIZE=k_cache.shape[1], HAS_NORM=has_norm,
            CLAMP=FP8_MAX if is_fp8(k_cache.dtype) else 0.0,
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_D=triton.next_power_of_2(head_dim), RNE_BY_HAND=rne_by_hand(qkv),
            num_warps=4,
        )  # fmt: skip
    return q
