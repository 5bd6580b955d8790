"""Store new K/V rows into the paged cache: one Triton program per token.

    slot = slot_mapping[t] = page * page_size + offset
    k_cache[page, offset, :, :] = k[t]        (same for v; cast to the cache dtype)

A negative slot means "padding row, write nothing" (a CUDA-graph batch's padding rows).
`store_latent` writes a one-component cache (MLA's latent rows) with the same kernel.
An FP8 cache (float8_e4m3fn, kv_cache_dtype "fp8") gets each value clamped to +-448 and
rounded to e4m3 (scale 1.0: batchgen/kv_quant.py), the bytes `kv_quant.to_cache` writes
in torch. The rounding is done in float32 (`e4m3_grid`), so the cast to float8 that
stores it is exact: the same bytes compiled and in Triton's interpreter, whose own
float8 cast truncates instead of rounding and drops the carry into the exponent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kv_quant import FP8_MAX, is_fp8


@triton.jit
def e4m3_grid(x, CLAMP: tl.constexpr):
    """x clamped to +-CLAMP (448) and rounded to the nearest e4m3 value (ties to even),
    as float32. Normal range: round the float32 bits to 3 mantissa bits. Below e4m3's
    smallest normal 2^-6 (subnormals: multiples of 2^-9), the same after adding 2^-6,
    which puts the value in [2^-6, 2^-5) where 3 mantissa bits are steps of 2^-9."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -CLAMP), CLAMP)
    a = tl.abs(x)
    small = a < 0.015625
    a = tl.where(small, a + 0.015625, a)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep sign, exponent, 3 bits
    a = bits.to(tl.float32, bitcast=True)
    a = tl.where(small, a - 0.015625, a)
    # x's sign bit put back on the magnitude: a negative value that rounds to zero stays
    # -0.0 (byte 0x80, as torch's cast writes it); Triton 3.6 compiles `-a` as 0 - a (+0.0)
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (a.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_kc_page, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_vc_page, stride_vc_off, stride_vc_h, stride_vc_d, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_V: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    if CLAMP > 0:  # an FP8 cache: saturated and rounded, the cast below exact
        k = e4m3_grid(k, CLAMP)
    kc = k_cache_ptr + page * stride_kc_page + off * stride_kc_off
    tl.store(kc + h * stride_kc_h + d * stride_kc_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_V:
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        if CLAMP > 0:
            v = e4m3_grid(v, CLAMP)
        vc = v_cache_ptr + page * stride_vc_page + off * stride_vc_off
        tl.store(
            vc + h * stride_vc_h + d * stride_vc_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask
        )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into the [pages, page_size, Hkv, D] caches at flat slots.

    k/v and the caches may be strided views (e.g. one layer of a pool tensor).
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [P, S, Hkv, D]: {k_cache.shape} / {v_cache.shape}")
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k/v {tuple(k.shape)} / {tuple(v.shape)} do not fit the cache")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}] int32/int64")
    if not (k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("k, v, caches and slot_mapping must be on one device")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_V=True,
        CLAMP=_clamp(k_cache), BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def store_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latent rows [T, W] into a one-component cache [pages, page_size, 1, W] (or
    [pages, page_size, W]; any strides) at flat slots; negative slots are skipped. No
    host synchronisation: CUDA-graph capturable."""
    if cache.dim() == 4 and cache.shape[2] == 1:
        cache = cache[:, :, 0]
    if cache.dim() != 3:
        raise ValueError(f"cache must be [P, S, 1, W] or [P, S, W], got {tuple(cache.shape)}")
    page_size, width = cache.shape[1], cache.shape[2]
    if latent.dim() != 2 or latent.shape[1] != width:
        raise ValueError(f"latent {tuple(latent.shape)} does not fit rows of {width}")
    if slot_mapping.shape != (latent.shape[0],) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(f"slot_mapping must be [{latent.shape[0]}] int32/int64")
    if not (latent.device == cache.device == slot_mapping.device):
        raise ValueError("latent, cache and slot_mapping must be on one device")
    num_tokens = latent.shape[0]
    if num_tokens == 0:
        return
    # one head: the latent row; v arguments repeat k's and are never read (HAS_V False)
    strides = (latent.stride(0), 0, latent.stride(1))
    cache_strides = (cache.stride(0), cache.stride(1), 0, cache.stride(2))
    _store_kv_kernel[(num_tokens,)](
        latent, latent, cache, cache, slot_mapping, *strides, *strides, *cache_strides,
        *cache_strides, NUM_KV_HEADS=1, HEAD_DIM=width, PAGE_SIZE=page_size, HAS_V=False,
        CLAMP=_clamp(cache), BLOCK_H=1, BLOCK_D=triton.next_power_of_2(width),
    )  # fmt: skip


def _clamp(cache: torch.Tensor) -> float:
    """The kernel's CLAMP: FP8's largest value for an FP8 cache, 0 (none) otherwise."""
    return FP8_MAX if is_fp8(cache.dtype) else 0.0
