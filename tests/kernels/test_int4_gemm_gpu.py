"""The INT4 kernels at real shapes on a GPU, in bf16: Kimi-K2-Thinking's routed experts
(hidden 7168, intermediate 2048, group 32) and a dense layer in group 128, at decode and
prefill row counts, against the torch reference over the same dequantized weights.
Outputs are poisoned with NaN first; each may differ from the reference by one bf16
rounding of a float32 sum taken in another order."""

from __future__ import annotations

import pytest
import torch
from int4_blocks import quantize_int4

from batchgen.kernels.fused_moe import align_pairs
from batchgen.kernels.int4_gemm import w4a16_gemm, w4a16_reference
from batchgen.kernels.int4_moe import TUNING, int4_moe_gemm

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _weights(shape, group, gen):
    w = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    packed, scale = quantize_int4(w, group)
    return packed.to(DEVICE), scale.to(DEVICE)


def _close(out, ref):
    assert torch.isfinite(out).all(), "non-finite outputs (left unwritten?)"
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize(
    ("n", "k", "group"), [(4096, 7168, 32), (7168, 2048, 32), (2048, 4096, 128)]
)
@pytest.mark.parametrize("m", [1, 16, 100, 512])
def test_w4a16_default_launches(m, n, k, group):
    gen = torch.Generator().manual_seed(m)
    packed, scale = _weights((n, k), group, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    w4a16_gemm(x, packed, scale, group, out=out)
    _close(out, w4a16_reference(x, packed, scale, group))


def test_w4a16_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(1)
    packed, scale = _weights((1024, 7168), 32, gen)
    x = torch.randn(4, 7168, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty(4, 1024, dtype=torch.bfloat16, device=DEVICE)
    w4a16_gemm(x, packed, scale, 32, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w4a16_gemm(x, packed, scale, 32, out=out)
    x.copy_(torch.randn(4, 7168, generator=gen).to(DEVICE, torch.bfloat16))
    graph.replay()
    _close(out, w4a16_reference(x, packed, scale, 32))


@pytest.mark.parametrize("tokens", [4, 512])
def test_int4_moe_gemm_at_kimi_k2_shapes(tokens):
    """gate_up [E, 2I, H] of 16 of Kimi-K2's experts (hidden 7168, inter 2048), top-8."""
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 7168, 2048, 8
    packed, scale = _weights((experts, 2 * inter, hidden), 32, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    flat = ids.reshape(-1).to(DEVICE)
    aligned = align_pairs(flat, experts, TUNING.block_m)
    out = int4_moe_gemm(x, packed, scale, 32, *aligned, tokens * top_k, top_k)
    ref = torch.empty_like(out)
    for e in range(experts):
        pairs = (flat == e).nonzero().flatten()
        ref[pairs] = w4a16_reference(x[pairs // top_k], packed[e], scale[e], 32)
    _close(out, ref)
