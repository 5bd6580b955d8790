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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import rne_by_hand, to_dtype

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _norm_rope_heads(
    src, dst, stride_dst_h, w_ptr, cos1, cos2, sin1, sin2, eps, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """NUM_HEADS heads of HEAD_DIM contiguous values at src -> dst (head stride given)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = dst.dtype.element_ty
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
    out = dst + head * stride_dst_h + d
    tl.store(out, to_dtype(out1, dtype, RNE_BY_HAND), mask=mask)
    tl.store(out + HALF, to_dtype(out2, dtype, RNE_BY_HAND), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, stride_qkv, stride_pos,
    stride_table, stride_qt, stride_qh, stride_kt, stride_kh, eps, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
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
    if out is None:
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
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
