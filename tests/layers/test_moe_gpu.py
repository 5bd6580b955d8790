"""DeepSeek-V3 MoE on a GPU in bfloat16: the grouped-GEMM path against the per-expert
loop, no host synchronisation, and a CUDA-graph replay equal to the eager step."""

from __future__ import annotations

import types
from functools import partial

import pytest
import torch

from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.routed_experts import fused_experts, grouped_mm_available

pytestmark = pytest.mark.gpu

HIDDEN, INTER, EXPERTS = 512, 128, 64


def layer(seed: int = 0) -> DeepseekV3MoE:
    cfg = types.SimpleNamespace(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    module = DeepseekV3MoE(cfg, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator("cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.05 if name.endswith("weight") or "proj" in name else 0.3
            p.copy_(scale * torch.randn(p.shape, generator=gen, device="cuda"))
        # the router as this family's checkpoints store it: bfloat16 values (float32
        # kept); after_load then gives the forward its bfloat16 copy, as build_model does
        module.gate.weight.copy_(module.gate.weight.bfloat16().float())
    module.gate.after_load()
    assert module.gate.weight_narrow is not None
    return module


@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_narrow_router_matches_the_float32_router(tokens):
    """The bfloat16 router GEMM with float32 products and sums against the float32 GEMM
    of the widened inputs: the same terms in another order, logits within float32
    rounding, the same experts wherever the choice is not a near tie."""
    gate = layer().gate
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    narrow = torch.mm(x, gate.weight_narrow.t(), out_dtype=torch.float32)
    wide = torch.nn.functional.linear(x.float(), gate.weight)
    assert narrow.dtype == torch.float32
    torch.testing.assert_close(narrow, wide, atol=1e-5, rtol=1e-5)
    weights, ids = gate(x)
    gate.weight_narrow = None
    ref_weights, ref_ids = gate(x)
    differ = (ids.sort(dim=-1).values != ref_ids.sort(dim=-1).values).any(dim=-1)
    assert differ.sum() <= max(1, tokens // 500), f"{int(differ.sum())} of {tokens} rows"
    same = ~differ
    torch.testing.assert_close(
        weights.sort(dim=-1).values[same], ref_weights.sort(dim=-1).values[same],
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_grouped_path_matches_the_loop(tokens):
    module = layer()
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_available(x)
    weights, ids = module.gate(x)
    experts = module.experts
    loop = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, False)
    grouped = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, True)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)


def test_forward_does_not_sync_and_replays_in_a_cuda_graph():
    module = layer()
    x = torch.randn(32, HIDDEN, device="cuda", dtype=torch.bfloat16)
    eager = module(x)  # warm-up: Triton compiles, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        module(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = _replay_after_capture(module, x)
    assert not torch.equal(out, eager)


def test_triton_experts_match_grouped_mm_and_replay(monkeypatch):
    """fused_experts(triton_moe=) (bench_kernels.py --moe): the routed experts on
    kernels/fused_moe.py's GEMMs give grouped_mm's outputs to bf16 rounding, captured
    and replayed in a CUDA graph; the layer's own forward stays on grouped_mm."""
    from batchgen.kernels.fused_moe import MoETuning
    from batchgen.layers import routed_experts

    module = layer()
    experts = module.experts

    def routed(x, triton_moe=None):
        weights, ids = module.gate(x)
        return fused_experts(
            x, experts.gate_up_proj, experts.down_proj, weights, ids, triton_moe=triton_moe
        )

    x = torch.randn(48, HIDDEN, device="cuda", dtype=torch.bfloat16)
    grouped = routed(x)
    calls = []
    gemm = routed_experts.moe_gemm
    monkeypatch.setattr(
        routed_experts, "moe_gemm", lambda *a, **k: calls.append(1) or gemm(*a, **k)
    )
    triton = partial(routed, triton_moe=MoETuning(16, 64, 128, 4, 4))
    eager = triton(x)
    assert len(calls) == 2  # gate_up and down
    torch.testing.assert_close(eager.float(), grouped.float(), atol=2e-2, rtol=2e-2)
    module(x)
    assert len(calls) == 2  # the layer: grouped_mm
    _replay_after_capture(triton, x)


def _replay_after_capture(module, x: torch.Tensor) -> torch.Tensor:
    """Capture module(x) in a CUDA graph (after a side-stream warm-up), refill x, replay:
    the replay's output must equal an eager forward of the new x; returns it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, module(x), atol=0, rtol=0)
    return out
