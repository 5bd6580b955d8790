"""A checkpoint's FP8 KV-cache scales (layers/kv_scales.py) in the attention layers.

Names of each format map to their layer (Qwen3, DeepSeek-V3 and Kimi Linear models route
them to the layer's attention); a per-head scale is cut to a rank's KV heads;
malformed scales are refused. One mixed step (decodes, a chunk after a cached prefix, a
fresh prompt) of `Attention` with per-head K and V scales, and of `MLAttention` with a
latent scale, over FP8 pages on the torch and Triton backends (the interpreter on the
CPU): the pages hold e4m3(x / scale), both backends agree, and the outputs stay within
FP8's rounding of the same step over float32 pages, although K, V and the latent run
past 448, where FP8 pages without the scales saturate.
"""

from __future__ import annotations

import pytest
import torch
from test_mla import PAGE, _config, _layer
from test_mla_triton import DEVICE, _mixed_step

from batchgen.forward_context import ForwardContext, bind_forward_context
from batchgen.kv_quant import FP8, to_cache
from batchgen.layers.attention import Attention
from batchgen.layers.kv_scales import KVScales, split_name


@pytest.mark.parametrize(
    "name, want",
    [
        ("layers.3.self_attn.k_scale", ("layers.3.self_attn", "k")),
        ("layers.3.self_attn.v_scale", ("layers.3.self_attn", "v")),
        ("layers.3.self_attn.kv_scale", ("layers.3.self_attn", "kv")),
        ("layers.0.self_attn.k_proj.k_scale", ("layers.0.self_attn", "k")),
        ("layers.0.self_attn.v_proj.v_scale", ("layers.0.self_attn", "v")),
        ("layers.0.self_attn.k_proj.weight_scale", None),
        ("layers.0.self_attn.k_proj.v_scale", None),
        ("layers.0.mlp.k_scale", None),
    ],
)
def test_checkpoint_names_map_to_their_layer(name, want):
    assert split_name(name) == want


def test_per_head_scales_are_cut_to_the_ranks_heads_and_one_value_spreads():
    rank1 = KVScales(2, first_head=2, total_heads=4)
    rank1.load("k", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    rank1.load("v", torch.tensor(5.0))
    assert rank1.k.tolist() == [3.0, 4.0] and rank1.k_shared is None
    assert rank1.v.tolist() == [5.0, 5.0] and rank1.v_shared == 5.0
    both = KVScales(2)
    both.load("kv", torch.tensor([2.0]))
    assert both.k.tolist() == both.v.tolist() == [2.0, 2.0] and not both.unit


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.ones(3), r"1 value \(per tensor\) or 4"),
        (torch.ones(4, 1), "shape"),
        (torch.tensor([1.0, -1.0, 1.0, 1.0]), "above 0"),
        (torch.tensor(float("inf")), "finite"),
    ],
)
def test_malformed_scales_are_refused(tensor, message):
    with pytest.raises(ValueError, match=message):
        KVScales(2, 0, 4).load("k", tensor)


def _attention_step(backend, k_cache, v_cache, layer, q, k, v, meta):
    ctx = ForwardContext(meta, [(k_cache, v_cache)], backend)
    with torch.no_grad(), bind_forward_context(ctx):
        return layer(q, k, v)[:-1]  # the padding row is ignored


def test_attention_with_per_head_scales_on_both_backends():
    gen = torch.Generator().manual_seed(3)
    heads, group, dim, num_pages, page_size = 2, 2, 16, 16, PAGE
    _, meta, _ = _mixed_step()
    meta.slot_mapping[-1] = 15 * PAGE  # the torch store writes padding rows: an unused page
    k_scale, v_scale = torch.tensor([8.0, 3.0]), torch.tensor([2.5, 6.0])
    spread = torch.tensor([400.0, 150.0]).view(1, 2, 1)  # up to ~4 x 448 before scaling
    old_k = torch.randn(num_pages, page_size, heads, dim, generator=gen) * spread
    old_v = torch.randn(num_pages, page_size, heads, dim, generator=gen) * spread.flip(1)
    t = meta.num_tokens
    q = (torch.randn(t, heads * group, dim, generator=gen) / 1000).to(DEVICE)
    k = (torch.randn(t, heads, dim, generator=gen) * spread).to(DEVICE)
    v = (torch.randn(t, heads, dim, generator=gen) * spread.flip(1)).to(DEVICE)
    layer = Attention(0, heads * group, heads, dim, 0.25)
    f32_k, f32_v = old_k.to(DEVICE, copy=True), old_v.to(DEVICE, copy=True)
    exact = _attention_step("torch", f32_k, f32_v, layer, q, k, v, meta)
    layer.load("k", k_scale)
    layer.load("v", v_scale)
    outs = {}
    for backend in ("torch", "triton"):
        k_cache = to_cache(old_k / k_scale[:, None], FP8).to(DEVICE)  # earlier steps'
        v_cache = to_cache(old_v / v_scale[:, None], FP8).to(DEVICE)
        outs[backend] = _attention_step(backend, k_cache, v_cache, layer, q, k, v, meta)
        slots = meta.slot_mapping
        stored = k_cache.view(-1, heads, dim)[slots].float()
        want = to_cache(k / k_scale.to(DEVICE)[:, None], FP8).float()
        assert torch.equal(stored, want), backend
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)
    err = (outs["torch"] - exact).abs().max().item()
    assert err < 0.05 * exact.abs().max().item(), err
    saturated = Attention(0, heads * group, heads, dim, 0.25)  # the scales left out
    k_cache, v_cache = to_cache(old_k, FP8).to(DEVICE), to_cache(old_v, FP8).to(DEVICE)
    out = _attention_step("torch", k_cache, v_cache, saturated, q, k, v, meta)
    assert (out - exact).abs().max().item() > 0.05 * exact.abs().max().item()


def test_mla_latent_scale_on_both_backends():
    config = _config()
    attn = _layer(config).to(DEVICE)
    attn.rotary.materialize(DEVICE)
    with torch.no_grad():
        attn.kv_a_layernorm.weight.mul_(1000.0)  # the latent's c_kv part past 448
        attn.kv_b_proj.weight.div_(1000.0)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    positions, meta, cached = _mixed_step()
    meta.slot_mapping[-1] = 15 * PAGE  # the torch store writes padding rows: an unused page
    gen = torch.Generator().manual_seed(4)
    old = torch.randn(16, PAGE, 1, width, generator=gen)
    old[..., : config.kv_lora_rank] *= 1000.0  # earlier steps' latents, c_kv as the layer's
    x = torch.randn(meta.num_tokens, config.hidden_size, generator=gen).to(DEVICE)

    def run(backend, cache):
        with torch.no_grad(), bind_forward_context(ForwardContext(meta, [(cache,)], backend)):
            return attn(positions, x)[:-1]

    exact = run("torch", old.clone().to(DEVICE))
    attn.load("k", torch.tensor(20.0))
    attn.load("v", torch.tensor(7.0))  # checked, not used by MLA
    outs = {b: run(b, to_cache(old / 20.0, FP8).to(DEVICE)) for b in ("torch", "triton")}
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)
    err = (outs["torch"] - exact).abs().max().item()
    assert err < 0.05 * exact.abs().max().item(), err
    attn.kv_scales = KVScales(1)  # the scale left out: the latent saturates
    out = run("torch", to_cache(old, FP8).to(DEVICE))
    assert (out - exact).abs().max().item() > 0.05 * exact.abs().max().item()


def test_each_model_routes_a_scale_to_its_layers_attention():
    """Llama/Qwen3: the layer's `attn` (per KV head); DeepSeek-V3 and Kimi Linear's MLA
    layers: the MLAttention itself (its latent)."""
    from conftest import tiny_config as tiny_llama
    from deepseek_checkpoints import tiny_config as tiny_deepseek
    from kimi_checkpoints import tiny_config as tiny_kimi

    from batchgen.layers.mla import MLAttention
    from batchgen.models.deepseek_v3 import DeepseekV3ForCausalLM
    from batchgen.models.kimi_linear import KimiLinearForCausalLM
    from batchgen.models.llama import Qwen3ForCausalLM

    cases = [
        (Qwen3ForCausalLM, tiny_llama("Qwen3ForCausalLM"), Attention),
        (DeepseekV3ForCausalLM, tiny_deepseek(), MLAttention),
        (KimiLinearForCausalLM, tiny_kimi(["linear_attention", "full_attention"]), MLAttention),
    ]
    for cls, config, kind in cases:
        with torch.device("meta"):
            model = cls(config, 64)
        for suffix, which in (("k_scale", "k"), ("v_proj.v_scale", "v"), ("kv_scale", "kv")):
            name = f"model.layers.1.self_attn.{suffix}"
            module, param, shard = model.checkpoint_target(name)
            assert isinstance(module, kind) and (param, shard) == (which, None), name
            assert module is model.layers[1].self_attn or module is model.layers[1].self_attn.attn
