"""The block-scaled FP8 kernels under the Triton interpreter (on the GPU when there is
one) against their torch references: activation quantization bit for bit, the W8A8 GEMM
within float32 summation-order error, partial blocks and bias included."""

from __future__ import annotations

import pytest
import torch
from fp8_blocks import quantize_blocks

from batchgen.kernels.fp8_gemm import (
    Fp8GemmTuning,
    block_scaled_mm,
    block_scaled_mm_reference,
)
from batchgen.kernels.fp8_quant import quantize_groups, quantize_groups_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def spread(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose columns span six decades, so groups hit e4m3's subnormals too."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * torch.logspace(-4, 2, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,group", [(5, 300, 128), (1, 128, 128), (17, 64, 32)])
def test_activation_quantization_matches_the_reference_bit_for_bit(dtype, m, k, group):
    x = spread(m, k, seed=m * k).to(dtype).to(DEVICE)
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-30])  # zero, negative zero, far below a step
    q, scale = quantize_groups(x, group)
    q_ref, scale_ref = quantize_groups_reference(x, group)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (m, -(-k // group))
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # the quantization is close: within half a step of e4m3 (2^-4 relative) per group
    back = q.float() * scale.repeat_interleave(group, 1)[:, :k]
    assert (back - x.float()).abs().max() <= x.float().abs().max() * 2**-4


def test_a_zero_group_quantizes_to_zeros():
    x = torch.zeros(2, 256, device=DEVICE)
    x[1, 128:] = 1.0
    q, scale = quantize_groups(x, 128)
    assert torch.equal(q.float()[0], torch.zeros(256, device=DEVICE))
    assert scale[1, 1].item() == pytest.approx(1 / 448) and q.float()[1, 128:].eq(448).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k,block",
    [
        (5, 70, 100, (16, 32)),
        (33, 64, 64, (32, 32)),
        (1, 48, 160, (16, 32)),
        (3, 40, 256, (128, 128)),
    ],
)
def test_gemm_matches_the_reference(m, n, k, block, bias):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen)
    wq, ws = (t.to(DEVICE) for t in quantize_blocks(w, block))
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    a, a_scale = quantize_groups(x, block[1])
    got = block_scaled_mm(a, a_scale, wq, ws, block, torch.float32, b)
    want = block_scaled_mm_reference(a, a_scale, wq, ws, block, b)
    assert got.shape == (m, n)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    # and the W8A8 product is close to the float one (checks the scales are applied)
    exact = x @ w.to(DEVICE).t() + (0 if b is None else b)
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


def test_gemm_rounds_once_to_the_output_dtype_and_takes_a_launch():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 96, generator=gen).to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in quantize_blocks(torch.randn(50, 96, generator=gen), (16, 32)))
    a, a_scale = quantize_groups(x, 32)
    want = block_scaled_mm_reference(a, a_scale, wq, ws, (16, 32))
    tuning = Fp8GemmTuning(block_m=16, block_n=16, num_warps=1, num_stages=1)
    got = block_scaled_mm(a, a_scale, wq, ws, (16, 32), torch.bfloat16, tuning=tuning)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_split_k_sums_the_same_products(split_k):
    """K's 5 blocks shared among split_k programs (8: more than there are blocks, the
    wrapper takes 5), bias added after the partials' sum."""
    gen = torch.Generator().manual_seed(split_k)
    x = torch.randn(3, 160, generator=gen).to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in quantize_blocks(torch.randn(40, 160, generator=gen), (16, 32)))
    b = torch.randn(40, generator=gen).to(DEVICE)
    a, a_scale = quantize_groups(x, 32)
    tuning = Fp8GemmTuning(block_m=16, block_n=16, num_warps=1, num_stages=1, split_k=split_k)
    got = block_scaled_mm(a, a_scale, wq, ws, (16, 32), torch.float32, b, tuning=tuning)
    want = block_scaled_mm_reference(a, a_scale, wq, ws, (16, 32), b)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_wrapper_refuses_mismatched_inputs():
    a = torch.zeros(4, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    a_scale = torch.ones(4, 2, device=DEVICE)
    w = torch.zeros(8, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="w_scale"):
        block_scaled_mm(a, a_scale, w, torch.ones(3, 2, device=DEVICE), (4, 32), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_scaled_mm(
            a.float(), a_scale, w, torch.ones(2, 2, device=DEVICE), (4, 32), torch.float32
        )
    with pytest.raises(ValueError, match="power of two"):
        quantize_groups(torch.zeros(2, 30, device=DEVICE), 24)
