"""quantization="fp8": a float checkpoint's linear layers quantized to block-scaled FP8 as
they load give the model an FP8 checkpoint of the same weights gives, and load_format
"dummy" gives the same layers random FP8 weights."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from fp8_blocks import quantize_checkpoint
from test_fp8_weights import LLAMA

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.layers.linear import Linear
from batchgen.layers.quant.fp8 import quantize_blocks
from batchgen.models.loader import ModelSource, build_model

KW = dict(device="cpu", page_size=4, max_model_len=64, num_kv_pages=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float checkpoint, FP8 checkpoint of its weights quantized by the package's own
    quantize_blocks with 128 x 128 blocks)."""
    base = tmp_path_factory.mktemp("online")
    plain, quant = base / "plain", base / "fp8"
    for d in (plain, quant):
        save_tiny_model(d, "LlamaForCausalLM", **LLAMA)
    quantize_checkpoint(quant, quantize=quantize_blocks)  # the same seed: plain's weights
    return plain, quant


def test_online_fp8_equals_the_fp8_checkpoint_of_the_same_weights(checkpoints):
    plain, quant = checkpoints
    prompts = [[5, 6, 7, 8], [40, 41, 300, 2, 9, 10, 11], list(range(30, 60))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    online = LLM(model=str(plain), quantization="fp8", **KW)
    model = online.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].mlp.down_proj.weight_scale_inv.shape == (2, 3)
    assert model.lm_head.weight.dtype == torch.float32
    a = online.generate(prompts, params, use_tqdm=False)
    b = LLM(model=str(quant), **KW).generate(prompts, params, use_tqdm=False)
    c = LLM(model=str(plain), **KW).generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for tid, entry in lx.items():
                assert entry.logprob == pytest.approx(ly[tid].logprob, abs=1e-6)
    # quantizing changed the numbers (the float model is another model)
    first = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in a]
    float_first = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in c]
    assert first != float_first


def test_dummy_weights_are_random_fp8_in_the_same_layers(checkpoints):
    plain, _ = checkpoints
    source = ModelSource.resolve(plain)
    config = source.load_config()
    model = build_model(
        source, config, torch.float32, torch.device("cpu"), 64, "dummy", quantization="fp8"
    )
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(layers) == 2 * config.num_hidden_layers * 2  # qkv, o, gate_up, down
    w = layers[0].dense_weight()
    assert w.std().item() == pytest.approx(0.02, rel=0.1)
    assert layers[0].weight.float().abs().max() > 1.5  # normal(0, 1) values in e4m3


def test_quantization_takes_fp8_only():
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        EngineConfig(quantization="int8")
    assert EngineConfig(quantization="fp8").model_config.quantization == "fp8"
