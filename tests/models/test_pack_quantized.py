"""models/pack_quantized.py: the compressed-tensors config read (what batchgen runs and
what it names as unsupported), the weight stream (kept layers' tensors as stored, other
packed weights dequantized, weight_shape checked), and the layers a config alone gives
INT4 (load_format "dummy")."""

from __future__ import annotations

import pytest
import torch
from deepseek_checkpoints import tiny_config
from int4_blocks import KIMI_K2_THINKING_IGNORE, quantization_config, quantize_int4

from batchgen.kernels.int4_gemm import dequantize_int4
from batchgen.models import pack_quantized
from batchgen.models.loader import ModelSource, build_model


class Config:
    def __init__(self, quant) -> None:
        self.quantization_config = quant


def test_the_scheme_of_kimi_k2_thinking_and_what_is_refused():
    scheme = pack_quantized.int4_scheme(Config(quantization_config(32, KIMI_K2_THINKING_IGNORE)))
    assert scheme.group_size == 32 and scheme.targets == ("Linear",)
    assert scheme.ignores(["model.layers.3.self_attn.q_a_proj"])
    assert scheme.ignores(["model.layers.0.mlp.gate_proj"])  # the dense layer's MLP
    assert not scheme.ignores(["model.layers.3.mlp.experts.17.gate_proj"])
    assert pack_quantized.int4_scheme(Config(None)) is None
    assert pack_quantized.int4_scheme(Config({"quant_method": "fp8"})) is None
    for key, value, named in [
        ("num_bits", 8, "num_bits"),
        ("symmetric", False, "symmetric"),
        ("strategy", "channel", "strategy"),
        ("group_size", 12, "group_size"),
        ("actorder", "group", "actorder"),
    ]:
        quant = quantization_config(32, [])
        quant["config_groups"]["group_0"]["weights"][key] = value
        with pytest.raises(ValueError, match=named):
            pack_quantized.int4_scheme(Config(quant))
    quant = quantization_config(32, [])
    quant["format"] = "float-quantized"
    with pytest.raises(ValueError, match="float-quantized"):
        pack_quantized.int4_scheme(Config(quant))


def _packed(name: str, rows: int, cols: int, seed: int):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    packed, scale = quantize_int4(w, 32)
    shape = torch.tensor([rows, cols])
    return [(name + "_packed", packed), (name + "_scale", scale), (name + "_shape", shape)]


def test_the_stream_keeps_or_dequantizes_each_packed_weight():
    a, b = _packed("a.weight", 4, 64, 0), _packed("b.weight", 6, 32, 1)
    other = ("norm.weight", torch.ones(3))
    # b's scale before its packed words: held until they come
    stream = a + [b[1], other, b[0], b[2]]
    out = dict(pack_quantized.int4_weights(stream, 32, keep={"a.weight"}))
    assert set(out) == {"a.weight_packed", "a.weight_scale", "b.weight", "norm.weight"}
    assert out["a.weight_packed"] is a[0][1]
    want = dequantize_int4(b[0][1], b[1][1], 32, 32)
    assert out["b.weight"].dtype == torch.float32 and torch.equal(out["b.weight"], want)


def test_the_stream_names_broken_pairs_and_shapes():
    a = _packed("a.weight", 4, 64, 0)
    with pytest.raises(ValueError, match=r"a\.weight has no scale"):
        list(pack_quantized.int4_weights([a[0]], 32, keep=set()))
    with pytest.raises(ValueError, match=r"a\.weight has no packed weight"):
        list(pack_quantized.int4_weights([a[1]], 32, keep=set()))
    wrong = ("a.weight_shape", torch.tensor([4, 128]))
    with pytest.raises(ValueError, match=r"a\.weight: packed \[4, 8\] does not hold"):
        list(pack_quantized.int4_weights([a[0], a[1], wrong], 32, keep={"a.weight"}))


def test_dummy_weights_follow_the_configs_ignore_list(tmp_path):
    """Kimi-K2-Thinking's ignore list on a DeepSeek-V3 config: the routed experts packed,
    attention, shared experts and the dense layer's MLP in the model's dtype; the MoE
    layer computes from the random packed weights."""
    config = tiny_config(first_k_dense_replace=1, n_shared_experts=1)
    config.quantization_config = quantization_config(32, KIMI_K2_THINKING_IGNORE)
    model = build_model(
        ModelSource(tmp_path), config, torch.float32, torch.device("cpu"), 64, "dummy"
    )
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.1.mlp.experts.gate_up_proj_packed"] == torch.int32
    assert dtypes["layers.1.mlp.experts.down_proj_scale"] == torch.float32
    assert "layers.1.mlp.experts.gate_up_proj" not in dtypes
    assert dtypes["layers.1.self_attn.o_proj.weight"] == torch.float32
    assert dtypes["layers.1.mlp.shared_experts.gate_up_proj.weight"] == torch.float32
    assert dtypes["layers.0.mlp.gate_up_proj.weight"] == torch.float32
    experts = model.layers[1].mlp.experts
    w = experts.weights()[0].dense()
    assert 0.01 < w.std().item() < 0.04  # about the float weights' 0.02
    out = model.layers[1].mlp(torch.randn(3, config.hidden_size))
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_an_int4_checkpoint_takes_no_quantization_option(tmp_path):
    config = tiny_config(first_k_dense_replace=1)
    config.quantization_config = quantization_config(32, KIMI_K2_THINKING_IGNORE)
    with pytest.raises(ValueError, match="quantization='fp8' on an INT4 pack-quantized"):
        build_model(
            ModelSource(tmp_path), config, torch.float32, torch.device("cpu"), 64, "dummy",
            quantization="fp8",
        )  # fmt: skip
