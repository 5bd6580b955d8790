"""kernels/mla_rope.py (MLA's rope, kv_norm and latent row in one launch) against its torch
reference and against layers/mla.py's op-by-op torch path, on small random inputs; and the
MLA layer on the GPU path against its torch path.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it),
where bf16 results are bit-equal to the reference's; with CUDA the same cases run
compiled, where products may fuse into FMAs (an element may land one bf16 ulp away).
"""

from __future__ import annotations

import pytest
import torch
from kernel_references import mla_rope_latent_reference

from batchgen.forward_context import ForwardContext, bind_forward_context
from batchgen.kernels.mla_rope import mla_rope_latent
from batchgen.layers.mla import deinterleave
from batchgen.layers.norm import rms_norm_torch
from batchgen.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
HEADS, NOPE, ROPE, RANK = 4, 16, 8, 32


class _Config:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def _rotary(max_positions=64):
    rotary = RotaryEmbedding(_Config(), ROPE, max_positions)
    rotary.materialize(DEVICE)
    return rotary


def _inputs(t, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q heads strided (every other head slot of a wider buffer), kv a slice of wider rows
    q_buf = (2 * torch.randn(t, 2 * HEADS, NOPE + ROPE, generator=gen)).to(DEVICE, dtype)
    kv_buf = (2 * torch.randn(t, RANK + ROPE + 5, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.3 * torch.randn(RANK, generator=gen)).to(DEVICE, dtype)
    positions = torch.tensor([0, 63, 7, 7, 30, 1][:t], device=DEVICE)
    return q_buf, q_buf[:, ::2], kv_buf[:, 2 : 2 + RANK + ROPE], weight, positions


def _assert_alike(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    elif DEVICE.type == "cpu":
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} elements differ"
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_matches_reference_in_place_on_strided_heads(dtype, interleaved, pos_dtype):
    rotary = _rotary()
    q_buf, q, kv, weight, positions = _inputs(6, dtype)
    positions = positions.to(pos_dtype)
    kv_before, others = kv.clone(), q_buf[:, 1::2].clone()
    ref_q, ref_latent = mla_rope_latent_reference(
        q, kv, positions, rotary.cos, rotary.sin, weight, EPS, NOPE, interleaved
    )
    nope_before = q[..., :NOPE].clone()
    latent = mla_rope_latent(
        q, kv, positions, rotary.cos, rotary.sin, weight, EPS, NOPE, interleaved
    )
    _assert_alike(q[..., NOPE:], ref_q[..., NOPE:])
    _assert_alike(latent, ref_latent)
    assert latent.shape == (6, RANK + ROPE) and latent.is_contiguous()
    assert torch.equal(q[..., :NOPE], nope_before), "q_nope must not be written"
    assert torch.equal(q_buf[:, 1::2], others), "heads outside q must not be written"
    assert torch.equal(kv, kv_before), "kv must not be written"


@pytest.mark.parametrize("interleaved", [True, False])
def test_matches_the_layers_op_by_op_torch_path(interleaved):
    """float32: the kernel computes what layers/mla.py's torch code does (regroup, neox
    rope, kv_norm, concatenation), to float32 rounding."""
    rotary = _rotary()
    _, q, kv, weight, positions = _inputs(5, torch.float32, seed=1)
    q_pe, k_pe = q[..., NOPE:].clone(), kv[:, RANK:]
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = rotary(positions, q_pe, k_pe[:, None])
    want = torch.cat((rms_norm_torch(kv[:, :RANK], weight, EPS), k_pe[:, 0]), -1)
    latent = mla_rope_latent(
        q, kv, positions, rotary.cos, rotary.sin, weight, EPS, NOPE, interleaved
    )
    torch.testing.assert_close(q[..., NOPE:], q_pe, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(latent, want, rtol=1e-5, atol=1e-5)


def test_no_tokens_and_bad_inputs():
    rotary = _rotary()
    _, q, kv, weight, positions = _inputs(6, torch.float32)
    args = (rotary.cos, rotary.sin, weight, EPS, NOPE, True)
    empty = mla_rope_latent(q[:0], kv[:0], positions[:0], *args)
    assert empty.shape == (0, RANK + ROPE)
    with pytest.raises(ValueError, match="nope"):
        mla_rope_latent(q[..., 1:], kv, positions, *args)
    with pytest.raises(ValueError, match="kv must be"):
        mla_rope_latent(q, kv[:, 1:], positions, *args)
    with pytest.raises(ValueError, match="share a dtype"):
        mla_rope_latent(q, kv.to(torch.float16), positions, *args)
    with pytest.raises(ValueError, match="positions"):
        mla_rope_latent(q, kv, positions.float(), *args)
    with pytest.raises(ValueError, match="cos/sin"):
        mla_rope_latent(q, kv, positions, rotary.cos.double(), rotary.sin.double(), *args[2:])


def _mla_config(interleaved):
    from types import SimpleNamespace

    return SimpleNamespace(
        num_attention_heads=HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=NOPE, hidden_size=64, attention_bias=False,
        q_lora_rank=None, rope_interleave=interleaved, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def _attend_inputs(monkeypatch, layer, runs):
    """Run the layer once per (device, fused) in runs on the torch backend (the latent
    rows stored apart), the store and attention replaced by a probe that records what it
    is given: [(q_nope, q_pe, latent)] in float32 on the CPU."""
    from batchgen.layers import mla as mla_module

    seen = []

    def probe(self, ctx, cache, q_nope, q_pe, latent):
        seen.append((q_nope.float().cpu(), q_pe.float().cpu(), latent.float().cpu()))
        return q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)

    monkeypatch.setattr(mla_module.MLAttention, "_store_and_attend", probe)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=gen)
    positions = torch.tensor([0, 63, 7, 7, 30, 1])
    for device, fused in runs:
        monkeypatch.setattr(mla_module, "fused_rope", lambda x, fused=fused: fused)
        layer.to(device)
        layer.rotary.materialize(torch.device(device))
        cache = torch.zeros(1, 4, 1, RANK + ROPE, device=device)  # not written: probed
        with bind_forward_context(ForwardContext(None, [(cache,)], "torch")):
            layer(positions.to(device), x.to(device))
    return seen


def _mla_layer(interleaved):
    from batchgen.layers.mla import MLAttention

    cfg = _mla_config(interleaved)
    torch.manual_seed(0)
    layer = MLAttention(cfg, 0, RotaryEmbedding(cfg, ROPE, 64))
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    return layer


@pytest.mark.parametrize("interleaved", [True, False])
def test_the_mla_layer_takes_the_kernel_as_its_torch_path(monkeypatch, interleaved):
    """MLAttention.forward with the fused launch (here in the interpreter, float32) gives
    attention the q_nope, q_pe and latent its op-by-op torch path gives."""
    layer = _mla_layer(interleaved)
    seen = _attend_inputs(monkeypatch, layer, [("cpu", False), (DEVICE.type, True)])
    for want, got in zip(seen[0], seen[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("interleaved", [True, False])
def test_the_mla_layer_on_the_gpu_matches_its_torch_path(interleaved):
    """On CUDA the layer takes the fused launch by itself (float32 here): attention gets
    what the layer's torch path on the CPU gives it."""
    from batchgen.layers import mla as mla_module

    with bind_forward_context(ForwardContext(None, [], "torch")):
        assert mla_module.fused_rope(torch.zeros(1, device="cuda"))
    layer = _mla_layer(interleaved)
    with pytest.MonkeyPatch.context() as mp:
        seen = _attend_inputs(mp, layer, [("cpu", False), ("cuda", True)])
    for want, got in zip(seen[0], seen[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
