"""Attention.forward_qkv: on the Triton backend one launch ropes q and k and writes K/V
(kernels/qk_norm_rope.py's qk_norm_rope_store), between the copy-ordering hooks; it gives
the bits of the rope kernel, store_kv and the attention of `forward` (the unfused path),
which it keeps where the pages are FP8 with KV scales. One mixed step (prefill chunks,
decodes, a padding row); the interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_mla import PAGE
from test_mla_triton import DEVICE, _mixed_step

from batchgen.forward_context import ForwardContext, bind_forward_context
from batchgen.kv_quant import FP8, to_cache
from batchgen.layers import attention_triton
from batchgen.layers.attention import Attention
from batchgen.layers.norm import RMSNorm
from batchgen.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, DIM, PAGES = 4, 2, 16, 16
DTYPE = torch.bfloat16


def _parts(with_norm: bool, gen):
    rotary = RotaryEmbedding(tiny_config("Qwen3ForCausalLM"), DIM, 64)
    rotary.materialize(DEVICE)
    norms = [None, None]
    if with_norm:
        norms = [RMSNorm(DIM, 1e-6).to(DEVICE, DTYPE) for _ in "qk"]
        for norm in norms:
            norm.weight.data.copy_(1 + 0.3 * torch.randn(DIM, generator=gen))
    return rotary, norms


def _pool(cache_dtype, gen):
    """[2 (K, V), pages, page_size, Hkv, D]: earlier steps' K/V, random."""
    pool = 3 * torch.randn(2, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    return to_cache(pool, FP8).to(DEVICE) if cache_dtype == FP8 else pool.to(DEVICE, cache_dtype)


def _run(layer, pool, fused: bool, qkv, positions, meta, rotary, norms, hooks=None):
    """The layer's output rows (padding row dropped): forward_qkv, or the unfused path."""
    hooks = hooks or {}
    ctx = ForwardContext(meta, [(pool[0], pool[1])], "triton", **hooks)
    with torch.no_grad(), bind_forward_context(ctx):
        if fused:
            return layer.forward_qkv(qkv, positions, rotary, *norms)[:-1]
        q, k = rotary.forward_qkv(positions, qkv, HEADS, KV_HEADS, *norms)
        v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(-1, KV_HEADS, DIM)
        return layer(q, k, v)[:-1]


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8 else pool


@pytest.mark.parametrize("cache_dtype, with_norm", [(DTYPE, True), (FP8, True), (DTYPE, False)])
def test_one_launch_between_the_hooks_gives_the_unfused_bits(monkeypatch, cache_dtype, with_norm):
    gen = torch.Generator().manual_seed(0)
    rotary, norms = _parts(with_norm, gen)
    positions, meta, _ = _mixed_step()
    qkv = (2 * torch.randn(meta.num_tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)).to(
        DEVICE, DTYPE
    )
    layer = Attention(0, HEADS, KV_HEADS, DIM, DIM**-0.5)
    ref_pool = _pool(cache_dtype, gen)
    pool, before = ref_pool.clone(), ref_pool.clone()
    ref = _run(layer, ref_pool, False, qkv, positions, meta, rotary, norms)
    calls = []

    def before_layer(layer_id):
        assert torch.equal(_bytes(pool), _bytes(before)), "K/V written before before_layer"
        calls.append(("before", layer_id))

    def on_kv_written(layer_id):
        assert torch.equal(_bytes(pool), _bytes(ref_pool)), "on_kv_written before the write"
        calls.append(("written", layer_id))

    def no_store(*args):
        raise AssertionError("the fused path launched store_kv")

    monkeypatch.setattr(attention_triton, "store_kv", no_store)
    hooks = dict(before_layer=before_layer, on_kv_written=on_kv_written)
    out = _run(layer, pool, True, qkv, positions, meta, rotary, norms, hooks)
    assert calls == [("before", 0), ("written", 0)]
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} output elements differ"
    assert torch.equal(_bytes(pool), _bytes(ref_pool))
    assert not torch.equal(_bytes(pool), _bytes(before)), "nothing was written"


def test_fp8_pages_with_kv_scales_keep_the_unfused_store(monkeypatch):
    """The scales divide k and v before the store: the one launch cannot write them."""
    gen = torch.Generator().manual_seed(1)
    rotary, norms = _parts(True, gen)
    positions, meta, _ = _mixed_step()
    qkv = (40 * torch.randn(meta.num_tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)).to(
        DEVICE, DTYPE
    )
    layer = Attention(0, HEADS, KV_HEADS, DIM, DIM**-0.5)
    layer.load("k", torch.tensor([2.0, 0.5]))
    layer.load("v", torch.tensor(8.0))
    ref_pool = _pool(FP8, gen)
    pool = ref_pool.clone()
    ref = _run(layer, ref_pool, False, qkv, positions, meta, rotary, norms)

    def no_fused(*args, **kwargs):
        raise AssertionError("scaled FP8 pages took the fused store")

    monkeypatch.setattr(RotaryEmbedding, "forward_qkv_store", no_fused)
    out = _run(layer, pool, True, qkv, positions, meta, rotary, norms)
    assert torch.equal(out, ref)
    assert torch.equal(_bytes(pool), _bytes(ref_pool))


def test_models_hand_qkv_over_on_cuda_or_the_triton_backend():
    layer = Attention(0, HEADS, KV_HEADS, DIM, 1.0)
    _, meta, _ = _mixed_step()
    qkv = torch.zeros(meta.num_tokens, (HEADS + 2 * KV_HEADS) * DIM, device=DEVICE)
    for backend, want in (("torch", DEVICE.type == "cuda"), ("triton", True)):
        with bind_forward_context(ForwardContext(meta, [], backend)):
            assert layer.takes_qkv(qkv) == want, backend
