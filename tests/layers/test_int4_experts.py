"""Routed experts held as INT4 (RoutedExperts.use_int4, layers/int4_experts.py):
filled shard by shard from compressed-tensors' packed tensors, they compute what plain
experts holding the same weights dequantized compute, on the CPU path (one expert
dequantized at a time) and through kernels/int4_moe.py (the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from int4_blocks import quantize_int4

from batchgen.kernels.fused_moe import MoETuning
from batchgen.kernels.int4_gemm import dequantize_int4
from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.routed_experts import RoutedExperts, fused_experts
from batchgen.layers.tp_group import TPGroup

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, HIDDEN, INTER = 6, 64, 40  # INTER 40: a partial second group of 32 in down_proj


def _per_expert(gen, group):
    """{(expert, part): (float weight dequantized, packed, scale)} for gate/up/down."""
    out = {}
    for e in range(E):
        for part, shape in (
            ("gate", (INTER, HIDDEN)),
            ("up", (INTER, HIDDEN)),
            ("down", (HIDDEN, INTER)),
        ):
            packed, scale = quantize_int4(torch.randn(*shape, generator=gen) * 0.2, group)
            dense = dequantize_int4(packed, scale, shape[1], group)
            out[e, part] = (dense, packed, scale)
    return out


def _experts(weights, group, tp=None, dtype=torch.float32):
    """(INT4 experts, plain experts holding the dequantized weights), loaded by shard."""
    with torch.device("meta"):
        int4 = RoutedExperts(E, HIDDEN, INTER, dtype, tp=tp)
        int4.use_int4(group, dtype)
        plain = RoutedExperts(E, HIDDEN, INTER, dtype, tp=tp)
    int4.to_empty(device=DEVICE)
    plain.to_empty(device=DEVICE)
    for (e, part), (dense, packed, scale) in weights.items():
        param = "down_proj" if part == "down" else "gate_up_proj"
        int4.load(f"{param}_packed", packed, f"{e}.{part}")
        int4.load(f"{param}_scale", scale, f"{e}.{part}")
        plain.load(param, dense, f"{e}.{part}")
    return int4, plain


def _routing(t, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=gen).to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_experts_compute_the_dequantized_experts(group):
    gen = torch.Generator().manual_seed(group)
    int4, plain = _experts(_per_expert(gen, group), group)
    assert int4.gate_up_proj_packed.dtype == torch.int32
    assert int4.gate_up_proj_packed.shape == (E, 2 * INTER, HIDDEN // 8)
    assert int4.down_proj_scale.shape == (E, HIDDEN, -(-INTER // group))
    assert not hasattr(int4, "gate_up_proj")  # no float copy of the weights
    x = torch.randn(9, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = _routing(9, 2, gen)
    torch.testing.assert_close(int4(x, weights, ids), plain(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_triton_moe_on_packed_experts_matches_the_expert_loop():
    """fused_experts' Triton path (kernels/int4_moe.py) against its reference path (one
    expert dequantized at a time), both on the same PackedExperts."""
    gen = torch.Generator().manual_seed(7)
    int4, _ = _experts(_per_expert(gen, 32), 32)
    gate_up, down = int4.weights()
    x = torch.randn(11, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = _routing(11, 3, gen)
    ref = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    small = MoETuning(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)
    out = fused_experts(x, gate_up, down, weights, ids, triton_moe=small)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_an_expert_parallel_block_holds_only_its_experts():
    """Rank 1 of 2 holds experts 3..5, packed; another rank's shard is skipped."""
    gen = torch.Generator().manual_seed(3)
    tp = TPGroup(rank=1, size=2, group=None)
    int4, plain = _experts(_per_expert(gen, 32), 32, tp=tp)
    assert int4.gate_up_proj_packed.shape[0] == 3 and int4.shard_names("down_proj_scale") == [
        "3.down",
        "4.down",
        "5.down",
    ]
    x = torch.randn(5, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = _routing(5, 2, gen)
    torch.testing.assert_close(int4(x, weights, ids), plain(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_load_names_the_int4_parameters():
    gen = torch.Generator().manual_seed(4)
    int4, _ = _experts(_per_expert(gen, 32), 32)
    with pytest.raises(ValueError, match="gate_up_proj_packed, gate_up_proj_scale"):
        int4.load("gate_up_proj", torch.zeros(INTER, HIDDEN), "0.gate")
    with pytest.raises(ValueError, match="shape"):
        int4.load("gate_up_proj_scale", torch.zeros(INTER, 3), "0.gate")


def test_the_moe_layer_is_graph_safe_on_cuda_with_int4_experts():
    import types

    config = types.SimpleNamespace(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=E, num_experts_per_tok=2,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        scoring_func="sigmoid", n_shared_experts=0, hidden_act="silu",
    )  # fmt: skip
    with torch.device("meta"):
        layer = DeepseekV3MoE(config, torch.float32)
        layer.experts.use_int4(32, torch.float32)
    assert layer.graph_safe(torch.float32, "cuda")  # the Triton GEMMs: no host sync
    assert not layer.graph_safe(torch.float32, "cpu")
