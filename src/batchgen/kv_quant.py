"""The KV cache's storage dtype: the model's compute dtype, or FP8 (`kv_cache_dtype`).

kv_cache_dtype "auto" keeps K/V pages (MLA: the latent) in the compute dtype. "fp8" (or
its full name "fp8_e4m3", vLLM's two spellings) stores them as float8_e4m3fn, one byte
a value. What is written here is what the attention layers hand over: K and V already
divided by a checkpoint's calibrated k_scale / v_scale (layers/kv_scales.py, which
folds the scales into the attention around the kernels), or as they are, a scale of
1.0, as vLLM stores them when a checkpoint carries none:

    write:  cache = e4m3(clamp(x, -448, 448))      round to nearest, saturated
    read:   x' = float(cache)                       upcast, no scale to apply

e4m3 keeps 3 mantissa bits (a relative error up to 1/16) over 2^-6 .. 448, and
subnormals down to 2^-9; a |value| above 448 saturates.

The page pool, the host tier and every copy between them hold the FP8 bytes as they
are; the store kernels quantize, the attention kernels and torch paths upcast on read.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
# EngineConfig.kv_cache_dtype's values: the compute dtype, or FP8 (two names for it)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_storage_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype KV pages are stored in: float8_e4m3fn for "fp8"/"fp8_e4m3", else
    `compute` (the model's compute dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return compute if kv_cache_dtype == "auto" else FP8


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: cast, saturating at +-FP8_MAX when `dtype` is FP8."""
    if is_fp8(dtype):
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes as uint8 (same shape and strides), anything else as it is:
    torch's index_copy_ has no float8 kernel on the CPU, and a scatter of pages only
    moves bytes."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [N, ...] rows at `slots` = rows (any float dtype), quantized as `to_cache`."""
    raw(cache).index_copy_(0, slots, raw(to_cache(rows, cache.dtype)))
