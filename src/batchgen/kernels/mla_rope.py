"""MLA's rotary embedding and latent row in one Triton launch: one program per (token,
part), part 0 the queries' rope slices, part 1 the token's latent.

    q row [H, nope + rope]:  [ q_nope | q_pe ] per head; q_pe rotated in place
    kv row [C + R]:          [ c_kv (kv_lora_rank C) | k_pe (R) ]   (kv_a_proj's output)
    latent row [C + R]:      [ kv_norm(c_kv) | rope(k_pe) ]          (a new tensor)

The rope is neox-style over the rope slice after regrouping an interleaved one (pairs
(x0, x1), (x2, x3), ... stored side by side, DeepSeek-V3's checkpoints) as [evens | odds],
read with a stride of 2 instead of copied; the slice is written back regrouped, as
layers/mla.py's torch path leaves it (scores are the same under any common order of q's
and k's rope dimensions). kv_norm rounds as layers/norm.py does; the rope is computed in
float32 from the float32 tables and rounded once (the op-by-op torch path rounds each op
to the dtype, so bf16 results differ from it by an ulp here and there).

In place of: two regrouping copies, the op-by-op rope of q and k (table gathers, casts,
products, the rotate-half copies), the norm, and the latent's concatenation.

`mla_rope_store` writes the latent rows straight into the layer's pages at the tokens'
slots instead (store_kv.store_latent's launch folded in): a negative slot writes none, an
FP8 page gets store_latent's saturated e4m3 rounding (`e4m3_grid`) of the row rounded
to q's dtype, so the pages hold the bytes mla_rope_latent then store_latent write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.qk_norm_rope import rope_width
from batchgen.kernels.rounding import rne_by_hand, to_dtype
from batchgen.kernels.store_kv import e4m3_grid
from batchgen.kv_quant import FP8_MAX, is_fp8

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _latent_row(
    row, out, stride_w, w_ptr, cos1, cos2, sin1, sin2, first, second, step, eps,
    dtype: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_C: tl.constexpr, CLAMP: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """kv_norm(c_kv) | rope(k_pe) of the kv row at `row`, rounded to dtype, written at
    `out` (elements stride_w apart; FP8 rounded by e4m3_grid first where CLAMP)."""
    HALF: tl.constexpr = ROPE // 2
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    c = tl.arange(0, BLOCK_C)
    cmask = c < RANK
    h = tl.load(row + c, mask=cmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) * (1.0 / RANK) + eps)
    w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    n = to_dtype(h * rstd, dtype, RNE_BY_HAND).to(tl.float32)
    c_kv = to_dtype(w * n, dtype, RNE_BY_HAND)
    k1 = tl.load(row + RANK + first + step * d, mask=dmask, other=0.0).to(tl.float32)
    k2 = tl.load(row + RANK + second + step * d, mask=dmask, other=0.0).to(tl.float32)
    k1, k2 = (
        to_dtype(k1 * cos1 - k2 * sin1, dtype, RNE_BY_HAND),
        to_dtype(k2 * cos2 + k1 * sin2, dtype, RNE_BY_HAND),
    )
    if CLAMP > 0:  # an FP8 page: saturated and rounded, the cast below exact
        c_kv, k1, k2 = e4m3_grid(c_kv, CLAMP), e4m3_grid(k1, CLAMP), e4m3_grid(k2, CLAMP)
    out_dtype = out.dtype.element_ty
    tl.store(out + c * stride_w, c_kv.to(out_dtype), mask=cmask)
    tl.store(out + (RANK + d) * stride_w, k1.to(out_dtype), mask=dmask)
    tl.store(out + (RANK + HALF + d) * stride_w, k2.to(out_dtype), mask=dmask)


@triton.jit
def _mla_rope_kernel(
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, lat_ptr, slot_ptr, stride_qt, stride_qh,
    stride_kv, stride_pos, stride_table, stride_lat, stride_page, stride_w, eps,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr,
    INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr, STORE: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_C: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """STORE: lat_ptr is the pages (stride_page, stride_lat: a slot's stride within a
    page), slot_ptr the slots; else lat_ptr is the rows (stride_lat a row's)."""
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    dtype = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    cos1 = tl.load(cos_ptr + pos * stride_table + d, mask=dmask, other=0.0)
    cos2 = tl.load(cos_ptr + pos * stride_table + HALF + d, mask=dmask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_table + d, mask=dmask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_table + HALF + d, mask=dmask, other=0.0)
    if INTERLEAVED:  # the two halves of the regrouped slice: even and odd dimensions
        first, second, step = 0, 1, 2
    else:
        first, second, step = 0, HALF, 1
    if tl.program_id(1) == 0:
        head = tl.arange(0, BLOCK_H)[:, None]
        mask = (head < NUM_HEADS) & dmask
        src = q_ptr + t * stride_qt + head * stride_qh + NOPE
        q1 = tl.load(src + first + step * d, mask=mask, other=0.0).to(tl.float32)
        q2 = tl.load(src + second + step * d, mask=mask, other=0.0).to(tl.float32)
        tl.store(src + d, to_dtype(q1 * cos1 - q2 * sin1, dtype, RNE_BY_HAND), mask=mask)
        tl.store(src + HALF + d, to_dtype(q2 * cos2 + q1 * sin2, dtype, RNE_BY_HAND), mask=mask)
    elif STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # a negative slot: a padding row, no latent written
            page = slot // PAGE_SIZE
            out = lat_ptr + page * stride_page + (slot % PAGE_SIZE) * stride_lat
            _latent_row(
                kv_ptr + t * stride_kv, out, stride_w, w_ptr, cos1, cos2, sin1, sin2, first,
                second, step, eps, dtype, ROPE, RANK, BLOCK_HALF, BLOCK_C, CLAMP, RNE_BY_HAND,
            )  # fmt: skip
    else:
        _latent_row(
            kv_ptr + t * stride_kv, lat_ptr + t * stride_lat, stride_w, w_ptr, cos1, cos2,
            sin1, sin2, first, second, step, eps, dtype, ROPE, RANK, BLOCK_HALF, BLOCK_C,
            CLAMP, RNE_BY_HAND,
        )  # fmt: skip


def mla_rope_latent(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    nope_dim: int,
    interleaved: bool,
) -> torch.Tensor:
    """Rotate q's rope slices in place and return the latent rows [T, C + R].

    q [T, H, nope_dim + R] (rows and heads may be strided, contiguous within a head);
    kv [T, C + R] (kv_a_proj's output, rows may be strided, contiguous within a row), only
    read; positions [T] (int32/int64) index the float32 cos/sin tables [P, R] (neox: both
    halves filled), not bounds-checked (no host sync); norm_weight [C] (kv_norm's weight,
    eps its epsilon) in q's dtype. interleaved: the rope slices hold interleaved pairs."""
    rank = _check(q, kv, positions, cos, sin, norm_weight, nope_dim)
    num_tokens, rope = q.shape[0], cos.shape[1]
    latent = torch.empty((num_tokens, rank + rope), dtype=q.dtype, device=q.device)
    slots = torch.empty(0, dtype=torch.int64, device=q.device)  # not read
    strides = (latent.stride(0), 0, latent.stride(1))
    _launch(q, kv, positions, cos, sin, norm_weight, eps, nope_dim, interleaved, latent, slots,
            strides, 1, rank, store=False)  # fmt: skip
    return latent


def mla_rope_store(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    nope_dim: int,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """mla_rope_latent with the latent rows written into `cache` ([pages, page_size, 1,
    C + R] or [pages, page_size, C + R], any strides; q's dtype or FP8 e4m3) at
    slot_mapping [T] (int32/int64; negative: skipped) instead of returned: the bytes
    store_latent writes of mla_rope_latent's rows. No host synchronisation, nothing
    allocated: CUDA-graph capturable."""
    rank = _check(q, kv, positions, cos, sin, norm_weight, nope_dim)
    if cache.dim() == 4 and cache.shape[2] == 1:
        cache = cache[:, :, 0]
    if cache.dim() != 3 or cache.shape[2] != rank + cos.shape[1]:
        raise ValueError(f"cache {list(cache.shape)} does not hold rows of {rank + cos.shape[1]}")
    if not is_fp8(cache.dtype) and cache.dtype != q.dtype:
        raise ValueError(f"cache must be FP8 or {q.dtype}: {cache.dtype}")
    if slot_mapping.shape != (q.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{q.shape[0]}] int32/int64")
    if not (cache.device == slot_mapping.device == q.device):
        raise ValueError("q, cache and slot_mapping must be on one device")
    strides = (cache.stride(1), cache.stride(0), cache.stride(2))
    _launch(q, kv, positions, cos, sin, norm_weight, eps, nope_dim, interleaved, cache,
            slot_mapping, strides, cache.shape[1], rank, store=True)  # fmt: skip


def _check(q, kv, positions, cos, sin, norm_weight, nope_dim) -> int:
    """The latent rank C, or ValueError naming what does not fit."""
    if q.dim() != 3 or q.dtype not in _DTYPES or q.stride(2) != 1:
        raise ValueError(f"q must be [T, H, D] contiguous within a head: {list(q.shape)}")
    num_tokens, num_heads, width = q.shape
    rope = rope_width(cos, sin)
    if width != nope_dim + rope:
        raise ValueError(f"q heads are {width} wide, not nope {nope_dim} + rope {rope}")
    rank = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    if kv.dim() != 2 or kv.shape != (num_tokens, rank + rope) or kv.stride(1) != 1:
        raise ValueError(
            f"kv must be [{num_tokens}, {rank} + {rope}] with contiguous rows: {list(kv.shape)}"
        )
    if kv.dtype != q.dtype or norm_weight.dtype != q.dtype or norm_weight.stride(0) != 1:
        raise ValueError(
            f"q, kv and norm_weight must share a dtype: {q.dtype} {kv.dtype} {norm_weight.dtype}"
        )
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{num_tokens}] int32/int64: {positions.shape}")
    if len({q.device, kv.device, positions.device, cos.device, norm_weight.device}) != 1:
        raise ValueError("q, kv, positions, cos/sin and norm_weight must be on one device")
    return rank


def _launch(q, kv, positions, cos, sin, norm_weight, eps, nope_dim, interleaved, out, slots,
            strides, page_size, rank, store) -> None:  # fmt: skip
    """strides: (a row's or a slot's, a page's, an element's) of `out`: the latent rows
    (store False: slots not read, no page stride) or the pages."""
    num_tokens, num_heads = q.shape[:2]
    rope = cos.shape[1]
    if num_tokens > 0:
        _mla_rope_kernel[(num_tokens, 2)](
            q, kv, positions, cos, sin, norm_weight, out, slots, q.stride(0), q.stride(1),
            kv.stride(0), positions.stride(0), cos.stride(0), *strides, eps,
            NUM_HEADS=num_heads, NOPE=nope_dim, ROPE=rope, RANK=rank, INTERLEAVED=interleaved,
            PAGE_SIZE=page_size, STORE=store,
            CLAMP=FP8_MAX if is_fp8(out.dtype) else 0.0,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(rope // 2),
            BLOCK_C=triton.next_power_of_2(rank), RNE_BY_HAND=rne_by_hand(q), num_warps=4,
        )  # fmt: skip
