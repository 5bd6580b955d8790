"""Per-token group quantization of activations to FP8 (float8_e4m3fn), the A side of the
block-scaled W8A8 GEMM (kernels/fp8_gemm.py).

Each row of x [M, K] is cut into groups of `group` columns (128, the weights' block
width; the last group may be partial). A group's scale is its largest magnitude over
448 (e4m3's largest finite value), and its values are x / scale, rounded to nearest
even in e4m3:

    x [M, K]  ->  q [M, K] float8_e4m3fn,  scale [M, ceil(K / group)] float32
                  x[m, k] ~= q[m, k] * scale[m, k // group]

One program per (row block, group). Triton's own float32 -> e4m3 conversion is not
torch's everywhere: the interpreter truncates, and on an H100 (Triton 3.6) the bytes
differed from torch's at model shapes. So the value is always first rounded onto e4m3's
grid by hand (`round_to_e4m3`, nearest even), after which any conversion of it is
exact: the kernel's bits equal `quantize_groups_reference`'s on the CPU and the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE_AMAX = 1e-10  # a group of zeros gets this amax (a scale, never a 0 division)


def quantize_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: (q [M, K] float8_e4m3fn, scale [M, ceil(K / group)] float32)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1).clamp_min(MIN_SCALE_AMAX)
    # divided by a tensor: torch on CUDA divides by a Python scalar as a product with its
    # reciprocal, which differs from the kernel's (and the CPU's) true division in the last bit
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) onto float8_e4m3fn's grid, nearest even, still float32:
    normal values keep 3 mantissa bits (bit rounding), subnormal ones (below 2^-6)
    become multiples of 2^-9 (adding and taking away 1.5 * 2^14 rounds there), sign kept."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    magic = 24576.0
    sub = (tl.abs(v) + magic) - magic  # the sign put back below: -0.0 stays -0.0
    sub_bits = sub.to(tl.uint32, bitcast=True) | (v.to(tl.uint32, bitcast=True) & 0x80000000)
    v = tl.where(tl.abs(v) < 0.015625, sub_bits.to(tl.float32, bitcast=True), normal)
    return v


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    v = tl.math.div_rn(x, scale[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    v = round_to_e4m3(v)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], v.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows * stride_sm + g, scale, mask=rows < M)


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32 / bfloat16 / float16, rows of unit stride) -> (q, scale) as the
    module docstring says; `group` a power of two >= 16."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with unit column stride, got {tuple(x.shape)}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 16, got {group}")
    m, k = x.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_m = 16 if group <= 128 else 4
    grid = (triton.cdiv(m, block_m), groups)
    _quantize_groups_kernel[grid](
        x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0),
        GROUP=group, BLOCK_M=block_m,
    )  # fmt: skip
    return q, scale
