"""The fused elementwise kernels at the shapes of a Qwen3-0.6B step on a GPU, in bf16.

T = 256 (a decode batch) and 8192 (a prefill chunk); hidden 1024, 16 query heads, 8 KV
heads, head_dim 128, intermediate 3072. Outputs are poisoned with NaN before each call.
Elementwise roundings match torch bit for bit; where a float32 sum of squares runs in
another order than torch's, or rope products fuse into FMAs, a rare element lands one bf16
ulp away.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from kernel_references import qk_norm_rope_reference, rms_norm_reference, silu_and_mul_reference

from batchgen.kernels.qk_norm_rope import qk_norm_rope
from batchgen.kernels.rms_norm import rms_norm
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.layers.activation import silu_and_mul as layer_silu_and_mul
from batchgen.layers.norm import RMSNorm, rms_norm_torch
from batchgen.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
MAX_POSITIONS = 40960
DTYPE = torch.bfloat16
EPS = 1e-6
DEVICE = "cuda"


def _randn(*shape, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, DTYPE)


def _weight(n, gen):
    return (1 + 0.3 * torch.randn(n, generator=gen)).to(DEVICE, DTYPE)


def _nan(*shape):
    return torch.full(shape, float("nan"), dtype=DTYPE, device=DEVICE)


def _assert_one_ulp_rarely(out, ref, atol=0.0, rare=1e-3):
    """No element further than an ulp of each of the two roundings in a row (the
    normalised value, then its product with the weight) plus atol; few differ at all."""
    assert torch.isfinite(out).all(), "non-finite outputs (rows left unwritten?)"
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=atol + 1e-6)
    differ = (out != ref).float().mean().item()
    assert differ < rare, f"{differ:.2e} of the elements differ"


@pytest.fixture(scope="module")
def rotary():
    cfg = tiny_config(
        "Qwen3ForCausalLM",
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
    )
    rotary = RotaryEmbedding(cfg, HEAD_DIM, MAX_POSITIONS)
    rotary.materialize(torch.device(DEVICE))
    return rotary


@pytest.mark.parametrize("t", [256, 8192])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(t, with_residual):
    gen = torch.Generator().manual_seed(t + with_residual)
    x = _randn(t, HIDDEN, gen=gen, scale=4.0)
    weight = _weight(HIDDEN, gen)
    out = _nan(t, HIDDEN)
    if with_residual:
        residual = _randn(t, HIDDEN, gen=gen, scale=20.0)
        res_out = _nan(t, HIDDEN)
        rms_norm(x, weight, EPS, residual, out=out, residual_out=res_out)
        ref, ref_res = rms_norm_reference(x, weight, EPS, residual)
        assert torch.equal(res_out, ref_res), "x + residual must round as torch's add"
    else:
        rms_norm(x, weight, EPS, out=out)
        ref = rms_norm_reference(x, weight, EPS)
    _assert_one_ulp_rarely(out, ref)


@pytest.mark.parametrize("t", [256, 8192])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope(rotary, t, with_norm):
    gen = torch.Generator().manual_seed(10 + t + with_norm)
    qkv = _randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, gen=gen, scale=2.0)
    positions = torch.randint(0, MAX_POSITIONS, (t,), generator=gen).to(DEVICE)
    positions[0] = MAX_POSITIONS - 1
    weights = (_weight(HEAD_DIM, gen), _weight(HEAD_DIM, gen)) if with_norm else (None, None)
    args = (qkv, positions, rotary.cos, rotary.sin, HEADS, KV_HEADS, *weights, EPS)
    q, k = _nan(t, HEADS, HEAD_DIM), _nan(t, KV_HEADS, HEAD_DIM)
    qk_norm_rope(*args, out=(q, k))
    ref_q, ref_k = qk_norm_rope_reference(*args)
    for got, ref in ((q, ref_q), (k, ref_k)):
        # a normalised input one ulp apart moves an output by up to an ulp of the input
        _assert_one_ulp_rarely(got, ref, atol=2**-7 * ref.float().abs().max().item())

    # against the op-by-op torch path (q_norm/k_norm, then a rope rounded after each op)
    q_in = qkv[:, : HEADS * HEAD_DIM].reshape(t, HEADS, HEAD_DIM)
    k_in = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].reshape(t, KV_HEADS, HEAD_DIM)
    if with_norm:
        q_in, k_in = rms_norm_torch(q_in, weights[0], EPS), rms_norm_torch(k_in, weights[1], EPS)
    torch_q, torch_k = rotary(positions, q_in, k_in)
    for got, ref in ((q, torch_q), (k, torch_k)):
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, f"relative error {rel:.2e} against the torch rope"


@pytest.mark.parametrize("t", [256, 8192])
def test_silu_and_mul(t):
    gen = torch.Generator().manual_seed(20 + t)
    x = _randn(t, 2 * INTER, gen=gen, scale=3.0)
    out = _nan(t, INTER)
    silu_and_mul(x, out=out)
    assert torch.equal(out, silu_and_mul_reference(x)), "silu(gate) * up must round as torch"


def test_layers_dispatch_to_the_kernels():
    gen = torch.Generator().manual_seed(30)
    x, residual = _randn(64, HIDDEN, gen=gen), _randn(64, HIDDEN, gen=gen)
    norm = RMSNorm(HIDDEN, EPS).to(DEVICE, DTYPE)
    norm.weight.data.copy_(_weight(HIDDEN, gen))
    got, got_res = norm.forward_residual(x, residual)
    want, want_res = rms_norm(x, norm.weight, EPS, residual)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, EPS))
    gate_up = _randn(64, 2 * INTER, gen=gen)
    assert torch.equal(layer_silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_kernels_replay_in_a_cuda_graph(rotary):
    """Captured once, replayed on new inputs: the same results as eager calls."""
    gen = torch.Generator().manual_seed(40)
    t = 256
    x, residual = _randn(t, HIDDEN, gen=gen), _randn(t, HIDDEN, gen=gen)
    qkv = _randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, gen=gen)
    positions = torch.zeros(t, dtype=torch.int64, device=DEVICE)
    gate_up = _randn(t, 2 * INTER, gen=gen)
    weight = _weight(HIDDEN, gen)
    q_weight, k_weight = _weight(HEAD_DIM, gen), _weight(HEAD_DIM, gen)

    def step():
        h, res = rms_norm(x, weight, EPS, residual)
        q, k = qk_norm_rope(
            qkv, positions, rotary.cos, rotary.sin, HEADS, KV_HEADS, q_weight, k_weight, EPS
        )
        return h, res, q, k, silu_and_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for buf in (x, residual, qkv, gate_up):
        buf.copy_(_randn(*buf.shape, gen=gen))
    positions.copy_(torch.randint(0, MAX_POSITIONS, (t,), generator=gen).to(DEVICE))
    graph.replay()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
