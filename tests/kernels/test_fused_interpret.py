"""The fused elementwise kernels (rms_norm, qk_norm_rope, silu_and_mul) against their torch
references and against the torch code of batchgen.layers, on small random inputs.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets it);
with CUDA the same small cases run compiled on the GPU. In the interpreter bf16 results
are bit-equal to torch's (the kernels round to nearest even by hand there). On the GPU a
float32 sum of squares runs in another order than torch's and rope products may fuse into
FMAs, so an element may land one bf16 ulp away there.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from kernel_references import qk_norm_rope_reference, rms_norm_reference, silu_and_mul_reference

from batchgen.kernels.qk_norm_rope import qk_norm_rope
from batchgen.kernels.rms_norm import rms_norm
from batchgen.kernels.silu_and_mul import SiluTuning, launch_for, silu_and_mul
from batchgen.layers.activation import silu_and_mul_torch
from batchgen.layers.norm import RMSNorm, rms_norm_torch
from batchgen.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def _randn(*shape, gen, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def _rows_view(rows, width, gen, dtype):
    """[rows, width] as a strided view into wider rows (as a slice of a fused projection)."""
    return _randn(rows, width + 7, gen=gen, scale=2.0, dtype=dtype)[:, 3 : 3 + width]


def _assert_rounded_alike(out, ref, exact_on_gpu=False):
    """bf16: bit-equal in the interpreter (and on the GPU if asked), else within one ulp;
    float32: within float32 rounding of a different summation order."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite outputs (left unwritten?)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    elif DEVICE.type == "cpu" or exact_on_gpu:
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} elements differ"
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm_matches_reference(dtype, with_residual, n):
    gen = torch.Generator().manual_seed(0)
    x = _rows_view(5, n, gen, dtype)
    weight = (1 + _randn(n, gen=gen, scale=0.3)).to(dtype)
    residual = _randn(5, n, gen=gen, dtype=dtype) if with_residual else None
    inputs = [t.clone() for t in (x, residual) if t is not None]
    out = torch.full((5, n), float("nan"), dtype=dtype, device=DEVICE)
    if with_residual:
        res_out = torch.full_like(out, float("nan"))
        got, got_res = rms_norm(x, weight, EPS, residual, out=out, residual_out=res_out)
        ref, ref_res = rms_norm_reference(x, weight, EPS, residual)
        assert got is out and got_res is res_out
        assert torch.equal(got_res, ref_res), "x + residual must round as torch's add"
    else:
        got = rms_norm(x, weight, EPS, out=out)
        ref = rms_norm_reference(x, weight, EPS)
        assert got is out
    _assert_rounded_alike(got, ref)
    for before, now in zip(inputs, [t for t in (x, residual) if t is not None]):
        assert torch.equal(before, now), "inputs must not be written"


def test_rms_norm_float32_weight_promotes_like_torch():
    gen = torch.Generator().manual_seed(1)
    x = _randn(3, 32, gen=gen, dtype=torch.bfloat16)
    weight = 1 + _randn(32, gen=gen, scale=0.3)
    got = rms_norm(x, weight, EPS)
    assert got.dtype == torch.float32
    _assert_rounded_alike(got, rms_norm_reference(x, weight, EPS))


def test_rms_norm_rejects_bad_inputs():
    x = torch.zeros(4, 16, device=DEVICE)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(16, device=DEVICE), EPS, x.to(torch.bfloat16))
    with pytest.raises(ValueError):
        rms_norm(x.t(), torch.ones(4, device=DEVICE), EPS)
    assert rms_norm(x[:0], torch.ones(16, device=DEVICE), EPS).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [40, 1100])
def test_silu_and_mul_matches_reference(dtype, inter):
    gen = torch.Generator().manual_seed(2)
    x = _rows_view(4, 2 * inter, gen, dtype)
    out = torch.full((4, inter), float("nan"), dtype=dtype, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    _assert_rounded_alike(out, silu_and_mul_reference(x), exact_on_gpu=True)


@pytest.mark.parametrize("tuning", [SiluTuning(4, 32, 4), SiluTuning(8, 16, 2)])
def test_silu_and_mul_tiles_cover_partial_rows_and_columns(tuning):
    """Tiles of several rows: 7 rows and 44 columns leave the last row block and the last
    column block partial; every output element is written once, nothing past them."""
    gen = torch.Generator().manual_seed(6)
    x = _rows_view(7, 2 * 44, gen, torch.bfloat16)
    buf = torch.full((8, 48), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = buf[:7, :44]
    assert silu_and_mul(x, out=out, tuning=tuning) is out
    _assert_rounded_alike(out, silu_and_mul_reference(x), exact_on_gpu=True)
    assert torch.isnan(buf[7]).all() and torch.isnan(buf[:, 44:]).all()


def test_silu_and_mul_launch_for_width():
    """One 1,024-wide row a program where I is a multiple of 1,024, else 16 x 128 tiles:
    the launches bench_kernels.py --silu found best at each of the MoE models' widths."""
    assert launch_for(1024) == launch_for(11264) == SiluTuning(1, 1024, 4)
    assert launch_for(1408) == launch_for(2816) == launch_for(40) == SiluTuning(16, 128, 4)


def _rotary(arch, head_dim, max_positions=64):
    cfg = tiny_config(arch)
    rotary = RotaryEmbedding(cfg, head_dim, max_positions)
    rotary.materialize(DEVICE)
    return rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_qk_norm_rope_matches_reference(dtype, with_norm, pos_dtype):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, t = 4, 2, 16, 6
    rotary = _rotary("LlamaForCausalLM", head_dim)
    qkv = _rows_view(t, (heads + 2 * kv_heads) * head_dim, gen, dtype)
    before = qkv.clone()
    positions = torch.tensor([0, 63, 7, 7, 30, 1], dtype=pos_dtype, device=DEVICE)
    weights = [(1 + _randn(head_dim, gen=gen, scale=0.3)).to(dtype) for _ in range(2)]
    weights = weights if with_norm else [None, None]
    # outputs with strided heads: every other head slot of wider buffers
    q_buf = torch.full((t, 2 * heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    k_buf = torch.full((t, 2 * kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    out = (q_buf[:, ::2], k_buf[:, ::2])
    args = (qkv, positions, rotary.cos, rotary.sin, heads, kv_heads, *weights, EPS)
    q, k = qk_norm_rope(*args, out=out)
    assert q is out[0] and k is out[1]
    ref_q, ref_k = qk_norm_rope_reference(*args)
    _assert_rounded_alike(q, ref_q)
    _assert_rounded_alike(k, ref_k)
    assert torch.isnan(q_buf[:, 1::2]).all() and torch.isnan(k_buf[:, 1::2]).all()
    assert torch.equal(qkv, before), "qkv must not be written"
    new_q, new_k = qk_norm_rope(*args)
    assert new_q.is_contiguous() and torch.equal(new_q, q) and torch.equal(new_k, k)


def test_rms_norm_matches_layers_torch_code():
    """The kernel rounds where layers/norm.py rounds: bit-equal in the interpreter."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16
    x = _randn(16, 256, gen=gen, scale=3.0, dtype=dtype)
    residual = _randn(16, 256, gen=gen, dtype=dtype)
    weight = (1 + _randn(256, gen=gen, scale=0.3)).to(dtype)
    got, got_res = rms_norm(x, weight, EPS, residual)
    assert torch.equal(got_res, x + residual)
    _assert_rounded_alike(got, rms_norm_torch(x + residual, weight, EPS))
    norm = RMSNorm(256, EPS).to(DEVICE, dtype)
    norm.weight.data.copy_(weight)
    layer_out, layer_res = norm.forward_residual(x, residual)
    assert torch.equal(layer_res, got_res)
    _assert_rounded_alike(layer_out, got)


def test_silu_and_mul_matches_layers_torch_code():
    gen = torch.Generator().manual_seed(5)
    x = _randn(8, 2 * 384, gen=gen, scale=3.0, dtype=torch.bfloat16)
    assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_forward_qkv_matches_layers_torch_code(arch):
    """RotaryEmbedding.forward_qkv (the fused kernel) against q_norm/k_norm + forward (the
    op-by-op torch rope, rounded after each op): within a few bf16 ulps."""
    gen = torch.Generator().manual_seed(6)
    dtype = torch.bfloat16
    cfg = tiny_config(arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rotary = _rotary(arch, head_dim, cfg.max_position_embeddings)
    t = 9
    qkv = _randn(t, (heads + 2 * kv_heads) * head_dim, gen=gen, scale=2.0, dtype=dtype)
    positions = torch.randint(0, cfg.max_position_embeddings, (t,), generator=gen).to(DEVICE)
    q_norm = k_norm = None
    if arch == "Qwen3ForCausalLM":
        q_norm, k_norm = RMSNorm(head_dim, EPS), RMSNorm(head_dim, EPS)
        for norm in (q_norm, k_norm):
            norm.to(DEVICE, dtype).weight.data.copy_(1 + _randn(head_dim, gen=gen, scale=0.3))
    q, k = rotary.forward_qkv(positions, qkv, heads, kv_heads, q_norm, k_norm)

    q_in = qkv[:, : heads * head_dim].reshape(t, heads, head_dim)
    k_in = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
    if q_norm is not None:
        q_in = rms_norm_torch(q_in, q_norm.weight, EPS)
        k_in = rms_norm_torch(k_in, k_norm.weight, EPS)
    ref_q, ref_k = rotary(positions, q_in, k_in)
    cos = rotary.cos[positions][:, None].double()
    sin = rotary.sin[positions][:, None].double()
    for got, ref, x in ((q, ref_q, q_in), (k, ref_k, k_in)):
        # each torch op rounds to bf16: errors scale with the inputs, not the outputs
        atol = 2**-6 * x.float().abs().amax(dim=-1, keepdim=True)
        assert ((got.float() - ref.float()).abs() <= atol + 2**-7 * ref.float().abs()).all()
        h = x.double()
        exact = h * cos + torch.cat((-h[..., head_dim // 2 :], h[..., : head_dim // 2]), -1) * sin
        assert (got.double() - exact).norm() < (ref.double() - exact).norm()
