"""The block-scaled FP8 GEMM at DeepSeek-V3's shapes on a GPU (bf16 out), against the
float32 torch reference; and torch's own blockwise `scaled_mm` on the same inputs, the
candidate the device benchmark measures beside it."""

from __future__ import annotations

import pytest
import torch
from fp8_blocks import quantize_blocks

from batchgen.kernels.fp8_gemm import (
    block_scaled_mm,
    block_scaled_mm_reference,
    default_tuning,
    scaled_mm_blockwise,
)
from batchgen.kernels.fp8_quant import quantize_groups, quantize_groups_reference

pytestmark = pytest.mark.gpu

BLOCK = (128, 128)
# (N, K): q_a_proj, o_proj, a dense MLP's down_proj at DeepSeek-V3's sizes
SHAPES = [(1536, 7168), (7168, 16384), (7168, 18432 // 8)]


def operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    wq, ws = (t.cuda() for t in quantize_blocks(torch.randn(n, k, generator=gen) * 0.02, BLOCK))
    return x, wq, ws


@pytest.mark.parametrize("m", [1, 16, 64, 512, 4096])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_matches_the_reference_at_model_shapes(m, n, k):
    x, wq, ws = operands(m, n, k, seed=m + n)
    a, a_scale = quantize_groups(x, BLOCK[1])
    q_ref, s_ref = quantize_groups_reference(x, BLOCK[1])
    assert torch.equal(a.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(a_scale, s_ref)
    got = block_scaled_mm(a, a_scale, wq, ws, BLOCK, torch.bfloat16)
    want = block_scaled_mm_reference(a, a_scale, wq, ws, BLOCK)
    assert got.dtype == torch.bfloat16 and default_tuning(m, x.device).block_m >= 16
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("m", [16, 512])
def test_torch_scaled_mm_takes_the_same_blocks(m):
    n, k = SHAPES[0]
    x, wq, ws = operands(m, n, k, seed=m)
    a, a_scale = quantize_groups(x, BLOCK[1])
    want = block_scaled_mm_reference(a, a_scale, wq, ws, BLOCK)
    got = scaled_mm_blockwise(a, a_scale, wq, ws, torch.bfloat16)
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_expert_gemm_matches_the_reference_at_model_shapes(tokens):
    """kernels/fp8_moe.py at a Kimi-K2-like expert shape (hidden 7168, intermediate
    2048 here cut to 16 experts), top-8, against the per-pair reference."""
    from batchgen.kernels.fp8_moe import TUNING, fp8_moe_gemm, fp8_moe_reference
    from batchgen.kernels.fused_moe import align_pairs

    experts, n, k, top_k = 16, 2 * 2048, 7168, 8
    gen = torch.Generator().manual_seed(tokens)
    pairs = [
        quantize_blocks(torch.randn(n, k, generator=gen) * 0.02, BLOCK) for _ in range(experts)
    ]
    w = torch.stack([q for q, _ in pairs]).cuda()
    w_scale = torch.stack([s for _, s in pairs]).cuda()
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.cuda()
    a, a_scale = quantize_groups(x, BLOCK[1])
    aligned = align_pairs(ids.reshape(-1), experts, TUNING.block_m)
    got = fp8_moe_gemm(
        a, a_scale, w, w_scale, BLOCK, *aligned, tokens * top_k, top_k, torch.bfloat16
    )
    check = slice(0, min(tokens * top_k, 64))  # the reference walks pairs one by one
    want = fp8_moe_reference(a, a_scale, w, w_scale, BLOCK, ids.reshape(-1)[check], top_k)
    scale = want.abs().max().item()
    assert torch.allclose(got[check].float(), want, rtol=2**-7, atol=1e-2 * scale)
