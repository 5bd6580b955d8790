"""The W8A8 emulation (tests/w8a8_emulation.py) that the GPU test of FP8 DeepSeek-V3
(test_fp8_weights_gpu.py) takes as its same-precision reference: its products equal the
W8A8 kernels' (under the Triton interpreter) within float32 summation-order error, a
dense layer's and the routed experts' alike, and on a tiny FP8 DeepSeek-V3 it multiplies
for every FP8 layer of the model and moves the logprobs off the dequantized model's."""

from __future__ import annotations

import torch
from fp8_blocks import quantize_blocks
from test_deepseek_v3 import _prompts
from test_fp8_weights import SAVERS, write_fp8_pair
from w8a8_emulation import W8A8Emulation

from batchgen import LLM, SamplingParams
from batchgen.kernels.fp8_gemm import block_scaled_mm
from batchgen.kernels.fp8_quant import quantize_groups
from batchgen.layers import routed_experts
from batchgen.layers.linear import Linear
from batchgen.layers.quant.fp8 import Fp8BlockMethod
from batchgen.layers.quant.fp8_experts import Fp8Experts
from batchgen.layers.routed_experts import RoutedExperts

BLOCK = (16, 32)


def _kernel(x, q, scale, bias=None):
    a, a_scale = quantize_groups(x, BLOCK[1])
    return block_scaled_mm(a, a_scale, q, scale, BLOCK, torch.float32, bias)


def _weights(n: int, k: int, seed: int, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return quantize_blocks(torch.randn(n, k, generator=gen) * spread, BLOCK)


def test_a_dense_layer_multiplies_as_the_w8a8_kernel(monkeypatch):
    """Partial blocks both ways (70 rows of 16-row blocks, 100 columns of 32), and rows
    whose groups span decades: the float32 product equals block_scaled_mm's on the
    kernel-quantized rows, and differs from the W8A16 product by the rows' rounding."""
    q, scale = _weights(70, 100, seed=1)
    layer = Linear(100, 70, bias=True)
    layer.use_method(Fp8BlockMethod(BLOCK))
    layer.load("weight", q)
    layer.load("weight_scale_inv", scale)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(70, generator=torch.Generator().manual_seed(2)))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 100, generator=gen) * torch.logspace(-3, 1, 100)
    plain = layer(x)  # W8A16 on the CPU: the dequantized weight, x as it is
    emulation = W8A8Emulation(monkeypatch)
    got = layer(x)
    assert emulation.linears == {id(layer)}
    want = _kernel(x, q, scale, layer.bias)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert (got - plain).abs().max() > 1e-3 * plain.abs().max()
    # bf16 rows: the same rounding onto e4m3, the float32 sum rounded once to bf16
    got16, want16 = layer(x.bfloat16()), _kernel(x.bfloat16(), q, scale, layer.bias)
    assert got16.dtype == torch.bfloat16
    assert torch.allclose(got16.float(), want16, rtol=2**-8, atol=1e-4)


def test_the_experts_loop_multiplies_as_the_w8a8_kernel_for_each_expert(monkeypatch):
    pairs = [_weights(48, 96, seed=e) for e in range(3)]
    experts = Fp8Experts(
        torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]), BLOCK
    )
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(11, 96, generator=gen)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1: no rows; row 10: elsewhere
    emulation = W8A8Emulation(monkeypatch)
    got = routed_experts.grouped_mm_loop(a, experts, offs)
    assert emulation.experts == {id(experts.weight)}
    for e, (start, end) in enumerate(((0, 4), (4, 4), (4, 10))):
        if end > start:
            want = _kernel(a[start:end], *pairs[e])
            assert torch.allclose(got[start:end], want, rtol=1e-5, atol=1e-4), e
    plain = routed_experts.grouped_mm_loop(a, experts.dense(), offs)  # a plain stack
    assert (got[:10] - plain[:10]).abs().max() > 1e-3 * plain[:10].abs().max()


def test_a_model_run_rounds_every_fp8_product(monkeypatch, tmp_path):
    """A tiny FP8 DeepSeek-V3 (a dense MLP layer, then MoE with shared experts), float32
    on the CPU: every FP8 Linear and both GEMMs of the routed experts go through the
    emulation, and the logprobs move off the W8A16 run's (the dequantized model) by the
    rounding of the activations."""
    quant, _, _ = write_fp8_pair(tmp_path, SAVERS["deepseek_v3"], reference=False)
    kw = dict(device="cpu", dtype="float32", page_size=4, max_model_len=128, num_kv_pages=64)
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def first_logprobs(llm):
        return [o.outputs[0].logprobs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = first_logprobs(LLM(model=str(quant), **kw))
    emulation = W8A8Emulation(monkeypatch)
    llm = LLM(model=str(quant), enforce_eager=True, **kw)
    emulated = first_logprobs(llm)
    model = llm.engine.runner.model
    fp8 = {id(m) for m in model.modules() if isinstance(m, Linear) and m.quant is not None}
    assert len(fp8) >= 11 and emulation.linears == fp8
    moe = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert moe and emulation.experts == {id(t) for m in moe for t in (m.gate_up_proj, m.down_proj)}
    moved = max(
        abs(a[t].logprob - b[t].logprob) for a, b in zip(plain, emulated) for t in a if t in b
    )
    assert moved > 1e-3, moved
