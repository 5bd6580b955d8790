"""The matrix product the attention kernels use, correct on the GPU and in the interpreter.

Triton's interpreter (TRITON_INTERPRET=1, how the kernels run on the CPU) keeps bfloat16
as raw uint16 and multiplies those integers in `tl.dot`, so a bf16 product there is
garbage. Kernels therefore take a `DOT_F32` flag: operands are upcast to float32 and
multiplied in IEEE precision when the inputs are float32 (no silent TF32) or when the
kernel runs on the CPU; on the GPU, bf16/fp16 operands go to the tensor cores as they are.
Accumulation is float32 either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_in_f32(x: torch.Tensor) -> bool:
    """The DOT_F32 flag for kernels reading `x`'s dtype on `x`'s device."""
    return x.dtype == torch.float32 or x.device.type != "cuda"


@triton.jit
def mma(a, b, DOT_F32: tl.constexpr):
    """a [M, K] @ b [K, N] -> float32 [M, N] (M, N, K >= 16)."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
