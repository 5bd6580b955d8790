"""Routed experts held as block-scaled FP8 (RoutedExperts.use_fp8, layers/quant/
fp8_experts.py): filled shard by shard from an FP8 checkpoint's weights and scales, they
compute what plain experts holding the same weights dequantized compute, on the CPU
path (one expert dequantized at a time) and, W8A8, through kernels/fp8_moe.py (the
interpreter on the CPU); a float weight is quantized as it loads."""

from __future__ import annotations

import pytest
import torch
from fp8_blocks import quantize_blocks

from batchgen.kernels.fused_moe import MoETuning
from batchgen.layers.quant import fp8_experts
from batchgen.layers.quant.fp8 import dequantize
from batchgen.layers.routed_experts import RoutedExperts, fused_experts
from batchgen.layers.tp_group import TPGroup

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, HIDDEN, INTER = 6, 64, 48  # HIDDEN 64 in blocks of 32 columns, INTER 48 of 16 rows
BLOCK = (16, 32)


def _per_expert(gen):
    """{(expert, part): (float weight dequantized, fp8 weight, scale)}."""
    out = {}
    for e in range(E):
        for part, shape in (
            ("gate", (INTER, HIDDEN)),
            ("up", (INTER, HIDDEN)),
            ("down", (HIDDEN, INTER)),
        ):
            q, scale = quantize_blocks(torch.randn(*shape, generator=gen) * 0.2, BLOCK)
            out[e, part] = (dequantize(q, scale, BLOCK), q, scale)
    return out


def _experts(weights, tp=None):
    """(FP8 experts, plain experts holding the dequantized weights), loaded by shard."""
    with torch.device("meta"):
        fp8 = RoutedExperts(E, HIDDEN, INTER, torch.float32, tp=tp)
        fp8.use_fp8(BLOCK)
        plain = RoutedExperts(E, HIDDEN, INTER, torch.float32, tp=tp)
    fp8.to_empty(device=DEVICE)
    plain.to_empty(device=DEVICE)
    for (e, part), (dense, q, scale) in weights.items():
        param = "down_proj" if part == "down" else "gate_up_proj"
        fp8.load(param, q, f"{e}.{part}")
        fp8.load(f"{param}_scale_inv", scale, f"{e}.{part}")
        plain.load(param, dense, f"{e}.{part}")
    return fp8, plain


def _routing(t, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=gen).to(DEVICE), ids.to(DEVICE)


def test_fp8_experts_hold_the_checkpoint_and_compute_the_dequantized_experts():
    gen = torch.Generator().manual_seed(0)
    weights = _per_expert(gen)
    fp8, plain = _experts(weights)
    assert fp8.gate_up_proj.dtype == torch.float8_e4m3fn
    assert fp8.gate_up_proj_scale_inv.shape == (E, 2 * INTER // 16, HIDDEN // 32)
    assert torch.equal(
        fp8.gate_up_proj[2, INTER:].cpu().view(torch.uint8), weights[2, "up"][1].view(torch.uint8)
    )
    gate_up, down = fp8.weights()
    assert torch.equal(gate_up.dense().cpu(), plain.gate_up_proj.cpu())
    x = torch.randn(9, HIDDEN, generator=gen).to(DEVICE)
    w, ids = _routing(9, 2, gen)
    got = fused_experts(x, gate_up, down, w, ids, use_grouped_mm=False)
    want = fused_experts(x, plain.gate_up_proj, plain.down_proj, w, ids, use_grouped_mm=False)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fp8(x, w, ids), want, rtol=1e-6, atol=1e-6)


def test_the_w8a8_expert_gemms_are_close_to_the_dequantized_experts():
    """kernels/fp8_moe.py through fused_experts: within the activations' quantization
    (1 x 32 groups in e4m3) of the plain experts, expert-parallel blocks included."""
    gen = torch.Generator().manual_seed(1)
    weights = _per_expert(gen)
    x = torch.randn(7, HIDDEN, generator=gen).to(DEVICE)
    w, ids = _routing(7, 3, gen)
    small = MoETuning(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)
    tuning = fp8_experts.FP8_MOE_TUNING if DEVICE.type == "cuda" else small
    for tp in (None, TPGroup(1, 2)):
        fp8, plain = _experts(weights, tp)
        first = None if tp is None else fp8.local_experts.start
        got = fused_experts(x, *fp8.weights(), w, ids, first_expert=first, triton_moe=tuning)
        want = fused_experts(
            x, plain.gate_up_proj, plain.down_proj, w, ids, first_expert=first, use_grouped_mm=False
        )
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert not torch.equal(got, want)  # the activations were quantized


def test_a_float_weight_is_quantized_into_fp8_experts():
    gen = torch.Generator().manual_seed(2)
    with torch.device("meta"):
        experts = RoutedExperts(E, HIDDEN, INTER, torch.float32)
        experts.use_fp8(BLOCK)
    experts.to_empty(device="cpu")
    up = torch.randn(INTER, HIDDEN, generator=gen)
    assert experts.filled_by("gate_up_proj", up) == ("gate_up_proj", "gate_up_proj_scale_inv")
    experts.load("gate_up_proj", up, "3.up")
    q, scale = quantize_blocks(up, BLOCK)
    assert torch.equal(experts.gate_up_proj[3, INTER:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv[3, INTER // 16 :], scale)
    with pytest.raises(ValueError, match="not whole 16-row blocks"):
        RoutedExperts(E, HIDDEN, 40, torch.float32, device="meta").use_fp8(BLOCK)
