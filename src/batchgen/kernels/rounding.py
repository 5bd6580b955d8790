"""Rounding float32 to a storage dtype as torch does, on the GPU and in the interpreter.

The fused elementwise kernels (rms_norm, qk_norm_rope, silu_and_mul) round where torch's
op-by-op code rounds, so that their results match it bit for bit. On the GPU a float32 ->
bfloat16 conversion rounds to nearest even, as torch does; Triton's interpreter
(TRITON_INTERPRET=1, how the kernels run on the CPU) truncates instead. Kernels therefore
take an `RNE_BY_HAND` flag, set on the CPU: the float32 bits are rounded to nearest even
by hand first, after which the interpreter's truncation is exact.

Their float32 exp is torch's too: `exp_as_torch` calls libdevice's expf, as torch's CUDA
kernels do, where the `libdevice_exp` flag says (on CUDA; the interpreter has none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def rne_by_hand(x: torch.Tensor) -> bool:
    """The RNE_BY_HAND flag for kernels writing bfloat16 on `x`'s device."""
    return x.device.type != "cuda"


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """float32 x rounded to nearest even in DTYPE (float32, bfloat16 or float16)."""
    if RNE_BY_HAND and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


def libdevice_exp(x: torch.Tensor) -> bool:
    """The LIBDEVICE flag of `exp_as_torch` for kernels on `x`'s device."""
    return x.device.type == "cuda"


@triton.jit
def exp_as_torch(x, LIBDEVICE: tl.constexpr):
    """float32 exp(x) as torch's CUDA kernels compute it: libdevice's expf (what they
    call); the interpreter has no libdevice, so on the CPU numpy's (LIBDEVICE false)."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)
