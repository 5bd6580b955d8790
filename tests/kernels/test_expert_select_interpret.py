"""The one-kernel expert choice (kernels/expert_select.py) against the torch ops of
layers/moe_routing.select_experts: the same experts in the same order, weights within a
float32 rounding, for sigmoid and softmax scoring, with and without the correction bias
and renormalisation. Under Triton's interpreter on the CPU (tests/conftest.py sets it),
compiled on the GPU where there is one, where select_experts itself takes the kernel."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.expert_select import expert_select
from batchgen.layers.moe_routing import RoutingConfig, select_experts, select_experts_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_choice(logits, bias, cfg):
    """select_experts' torch ops, wherever the tensors are."""
    return select_experts_torch(logits, bias, cfg)


CASES = [  # experts, top_k, tokens, scoring, bias, renormalise, scale
    (64, 6, 37, "sigmoid", True, True, 2.446),  # W6's router
    (64, 6, 1, "sigmoid", True, True, 2.446),
    (384, 8, 9, "sigmoid", True, True, 2.827),  # Kimi-K2's 384 experts
    (8, 2, 70, "softmax", False, False, 1.0),  # Qwen-style softmax, no renormalisation
    (10, 3, 5, "softmax", True, True, 1.0),  # experts not a power of two
    (16, 16, 4, "sigmoid", False, True, 1.0),  # every expert chosen
]


@pytest.mark.parametrize("experts,top_k,tokens,scoring,with_bias,renorm,scale", CASES)
def test_matches_the_torch_ops(experts, top_k, tokens, scoring, with_bias, renorm, scale):
    gen = torch.Generator().manual_seed(experts * 1000 + tokens)
    logits = (3 * torch.randn(tokens, experts, generator=gen)).to(DEVICE)
    bias = (0.1 * torch.randn(experts, generator=gen)).to(DEVICE) if with_bias else None
    cfg = RoutingConfig(
        num_experts=experts,
        top_k=top_k,
        norm_topk_prob=renorm,
        routed_scaling_factor=scale,
        scoring_func=scoring,
    )
    weights, ids = expert_select(
        logits, bias, top_k, scoring=scoring, renormalize=renorm, scale=scale
    )
    want_w, want_ids = torch_choice(logits, bias, cfg)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)  # the same experts, best first
    assert torch.allclose(weights, want_w, rtol=2e-6, atol=1e-7)
    if renorm:
        sums = weights.sum(dim=-1) / scale
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)


def test_the_bias_chooses_but_does_not_weigh():
    """An expert the bias lifts into the top_k is chosen, weighed by its unbiased score."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0], device=DEVICE)
    weights, ids = expert_select(logits, bias, 2, renormalize=False)
    assert ids.tolist() == [[3, 0]]
    assert torch.allclose(weights, torch.sigmoid(logits[:, [3, 0]]))


def test_equal_scores_go_to_the_lower_expert_first():
    logits = torch.zeros(3, 8, device=DEVICE)
    _, ids = expert_select(logits, None, 3)
    assert ids.tolist() == [[0, 1, 2]] * 3


def test_strided_rows_and_no_tokens():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 40, generator=gen).to(DEVICE)
    logits = wide[:, :32]  # a row stride of 40
    weights, ids = expert_select(logits, None, 4)
    w2, ids2 = expert_select(logits.contiguous(), None, 4)
    assert torch.equal(ids, ids2) and torch.equal(weights, w2)
    empty_w, empty_ids = expert_select(torch.empty(0, 32, device=DEVICE), None, 4)
    assert empty_w.shape == (0, 4) and empty_ids.shape == (0, 4)


def test_rejects_bad_inputs():
    logits = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        expert_select(logits.double(), None, 2)
    with pytest.raises(ValueError, match="top_k"):
        expert_select(logits, None, 9)
    with pytest.raises(ValueError, match="scoring"):
        expert_select(logits, None, 2, scoring="relu")
    with pytest.raises(ValueError, match="bias"):
        expert_select(logits, torch.zeros(7, device=DEVICE), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [512, 32768])
def test_select_experts_on_cuda_takes_the_kernel_at_w6_s_shape(tokens):
    """W6's router at a decode step's and a prefill step's size: select_experts on CUDA
    (the kernel) against the torch ops on the same device. The kernel's sigmoid is
    computed as torch's; should a last bit differ all the same, a choice may differ only
    between experts whose scores tie within a float32 rounding, in few tokens."""
    gen = torch.Generator().manual_seed(tokens)
    logits = (2 * torch.randn(tokens, 64, generator=gen)).cuda()
    bias = (0.05 * torch.randn(64, generator=gen)).cuda()
    cfg = RoutingConfig(num_experts=64, top_k=6, routed_scaling_factor=2.446)
    weights, ids = select_experts(logits, bias, cfg)
    want_w, want_ids = torch_choice(logits, bias, cfg)
    score = torch.sigmoid(logits) + bias
    assert torch.allclose(score.gather(1, ids), score.gather(1, want_ids), rtol=0, atol=1e-6)
    same = (ids == want_ids).all(dim=1)
    assert same.float().mean() > 0.999
    assert torch.allclose(weights[same], want_w[same], rtol=2e-6, atol=1e-7)
