"""A Llama checkpoint with quantized weights at tensor_parallel_size=2 against
tensor_parallel_size=1, on gloo: block-scaled FP8 (128 x 128, `weight_scale_inv`) and
compressed-tensors pack-quantized INT4 (g32). Each rank keeps quantized the slices that
are whole blocks (FP8: the MLP's) or whole words and groups (INT4: every projection's)
and generates what one process does: the same greedy tokens
and finish reasons, logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from fp8_blocks import quantize_checkpoint
from int4_blocks import write_pack_quantized
from test_tp_deepseek import _assert_same, _generate

SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow  # two engines, one of two ranks, over a 256-wide model
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_tp2_keeps_whole_blocks_quantized_and_equals_tp1(tmp_path, fmt):
    path = tmp_path / "ckpt"
    path.mkdir()
    save_tiny_model(path, "LlamaForCausalLM", **SIZES)
    if fmt == "fp8":
        quantize_checkpoint(path)
    else:
        plain = tmp_path / "plain"
        plain.mkdir()
        assert write_pack_quantized(path, plain, lambda n: "proj" in n, 32) == 14
    want, _ = _generate(str(path), num_kv_pages=200)
    got, llm = _generate(str(path), num_kv_pages=200, tensor_parallel_size=2)
    _assert_same(got, want)
    layer = llm.engine.runner.model.layers[0]
    if fmt == "fp8":
        assert layer.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn  # 256 of 512 rows
        assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn  # 256 of 512 columns
    else:
        assert layer.mlp.gate_up_proj.weight_packed.shape == (512, 32)  # 2 x 256 rows
        assert layer.mlp.down_proj.weight_packed.shape == (256, 32)  # 256 of 512 columns
        assert layer.self_attn.o_proj.weight_packed.shape == (256, 4)  # 32 of 64 columns
