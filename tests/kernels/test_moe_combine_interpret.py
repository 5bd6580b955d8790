"""The routed experts' weighted sum (kernels/moe_combine.py) under the Triton interpreter
(on the GPU when there is one) against its torch reference, and inside fused_experts."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.moe_combine import moe_combine, moe_combine_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(tokens: int, top_k: int, hidden: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    position = torch.randperm(tokens * top_k, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    return h.to(DEVICE), position.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(5, 6, 48), (3, 2, 1500), (1, 1, 8)])
def test_matches_the_reference(dtype, tokens, top_k, hidden):
    h, position, weights = case(tokens, top_k, hidden, dtype, seed=tokens + hidden)
    got = moe_combine(h, position, weights)
    want = moe_combine_reference(h, position, weights)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # float32 sums in one order on both sides; bfloat16 rounds that sum once
    assert torch.allclose(got.float(), want.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(5, 6, 48), (3, 2, 1500)])
def test_the_residual_is_added_as_the_unfused_add_would(dtype, tokens, top_k, hidden):
    """The shared experts' output added in the same pass: the bits of `sum + residual`
    in the output dtype (the sum rounded first), and the reference's."""
    h, position, weights = case(tokens, top_k, hidden, dtype, seed=tokens * hidden)
    gen = torch.Generator().manual_seed(hidden)
    residual = (4 * torch.randn(tokens, hidden, generator=gen)).to(dtype).to(DEVICE)
    got = moe_combine(h, position, weights, residual=residual)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert torch.equal(got, moe_combine(h, position, weights) + residual)
    want = moe_combine_reference(h, position, weights, residual)
    assert torch.allclose(got.float(), want.float(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, moe_combine(h, position, weights))  # it did add something


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN * 0
def test_a_zero_weight_pair_adds_nothing_whatever_its_row_holds():
    """Pairs outside this rank's experts: weight 0 and a row no GEMM wrote (NaN here)."""
    h, position, weights = case(4, 3, 32, torch.bfloat16, seed=1)
    weights[1, 2] = 0.0
    weights[3, 0] = 0.0
    h[position[1 * 3 + 2]] = float("nan")
    h[position[3 * 3 + 0]] = float("inf")
    got = moe_combine(h, position, weights)
    assert torch.isfinite(got.float()).all()
    clean = h.clone()
    clean[position[1 * 3 + 2]] = 0.0
    clean[position[3 * 3 + 0]] = 0.0
    assert torch.equal(got, moe_combine_reference(clean, position, weights))


def test_rejects_mismatched_inputs():
    h, position, weights = case(2, 3, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="position"):
        moe_combine(h, position[:-1], weights)
    with pytest.raises(ValueError, match="weights"):
        moe_combine(h, position, weights.double())
    with pytest.raises(ValueError, match="h must"):
        moe_combine(h.t(), position, weights)
    with pytest.raises(ValueError, match="residual must"):
        moe_combine(h, position, weights, residual=torch.zeros(2, 15, device=h.device))
    with pytest.raises(ValueError, match="residual must"):
        moe_combine(h, position, weights, residual=torch.zeros(2, 16, device=h.device).half())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_experts_on_cuda_matches_the_cpu_path(with_residual):
    """fused_experts on CUDA (grouped GEMMs, the kernel's sum) against the CPU path (one
    matmul per expert, the reference sum) in float32, experts outside this rank's block,
    with and without a residual (the shared experts' output) added in the sum's pass."""
    from batchgen.layers.routed_experts import fused_experts

    gen = torch.Generator().manual_seed(3)
    t, k, hidden, inter, experts = 37, 3, 64, 32, 4
    x = torch.randn(t, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights = torch.rand(t, k, generator=gen)
    ids = torch.randint(0, 2 * experts, (t, k), generator=gen)  # half outside the block
    residual = torch.randn(t, hidden, generator=gen) if with_residual else None
    want = fused_experts(x, gate_up, down, weights, ids, first_expert=4, residual=residual)
    args = (a.cuda() for a in (x, gate_up, down, weights, ids))
    res = None if residual is None else residual.cuda()
    got = fused_experts(*args, first_expert=4, residual=res)
    assert torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-4)
