"""The block-scaled FP8 expert GEMM (kernels/fp8_moe.py) under the Triton interpreter (on
the GPU when there is one) against its torch reference: pairs routed to every expert,
to none of this rank's (left out), and rows read through rows_per_token."""

from __future__ import annotations

import pytest
import torch
from fp8_blocks import quantize_blocks

from batchgen.kernels.fp8_moe import fp8_moe_gemm, fp8_moe_reference, tuning_for
from batchgen.kernels.fp8_quant import quantize_groups
from batchgen.kernels.fused_moe import MoETuning, align_pairs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TUNING = MoETuning(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)


def experts_fp8(e: int, n: int, k: int, block, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pairs = [quantize_blocks(torch.randn(n, k, generator=gen), block) for _ in range(e)]
    return torch.stack([q for q, _ in pairs]).to(DEVICE), torch.stack([s for _, s in pairs]).to(
        DEVICE
    )


@pytest.mark.parametrize(
    "tokens,top_k,e,n,k", [(5, 2, 4, 48, 96), (9, 3, 3, 40, 70), (1, 1, 2, 32, 64)]
)
def test_matches_the_reference(tokens, top_k, e, n, k):
    block = (16, 32)
    w, w_scale = experts_fp8(e, n, k, block, seed=tokens * e)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(tokens, k, generator=gen).to(DEVICE)
    experts = torch.randint(0, e + 1, (tokens * top_k,), generator=gen).to(DEVICE)  # e: elsewhere
    a, a_scale = quantize_groups(x, block[1])
    aligned = align_pairs(experts, e, TUNING.block_m)
    got = fp8_moe_gemm(
        a, a_scale, w, w_scale, block, *aligned, tokens * top_k, top_k, torch.float32, TUNING
    )
    want = fp8_moe_reference(a, a_scale, w, w_scale, block, experts, top_k)
    mine = experts < e
    assert torch.allclose(got[mine], want[mine], rtol=1e-5, atol=1e-4)


def test_each_launch_tuning_for_picks_gives_the_reference():
    """tuning_for's launches (16-, 32- and 64-row blocks) on one routing."""
    block = (16, 32)
    w, w_scale = experts_fp8(2, 40, 64, block, seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(70, 64, generator=gen).to(DEVICE)
    experts = torch.randint(0, 2, (140,), generator=gen).to(DEVICE)
    a, a_scale = quantize_groups(x, block[1])
    want = fp8_moe_reference(a, a_scale, w, w_scale, block, experts, 2)
    launches = {tuning_for(pairs, 2) for pairs in (20, 60, 140)}
    assert sorted(t.block_m for t in launches) == [16, 32, 64]
    for tuning in launches:
        aligned = align_pairs(experts, 2, tuning.block_m)
        got = fp8_moe_gemm(a, a_scale, w, w_scale, block, *aligned, 140, 2, torch.float32, tuning)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), tuning
