"""Block-scaled FP8 checkpoints (DeepSeek-V3's format) are dequantized as they load: a
model read from one equals the model read from its dequantized weights, token for token
and logprob for logprob; a broken pairing is an error naming the weight."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_model
from fp8_blocks import quantize_blocks
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.models import fp8

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, num_kv_pages=64)
BLOCK = (16, 32)  # rows x columns; the tiny model's 64/128-wide weights are not all multiples
_quantize = quantize_blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 dir, dir of the same weights dequantized): a tiny Llama whose projection
    weights are FP8 with per-block scales, one block size that leaves partial blocks."""
    base = tmp_path_factory.mktemp("fp8")
    plain, quant = base / "plain", base / "fp8"
    for d in (plain, quant):
        save_tiny_model(d, "LlamaForCausalLM")
    tensors = load_file(str(quant / "model.safetensors"))
    fp8_tensors, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            q, scale = _quantize(t.float(), BLOCK)
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = fp8.dequantize(q, scale, BLOCK)
        else:
            fp8_tensors[name] = dequantized[name] = t
    # the scale of one weight first, in a file of its own: pairing must not rely on order
    first = next(n for n in fp8_tensors if n.endswith("_scale_inv"))
    save_file({first: fp8_tensors.pop(first)}, str(quant / "model-00001.safetensors"))
    save_file(fp8_tensors, str(quant / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (quant / "config.json").write_text(json.dumps(config))
    return quant, plain


def test_fp8_checkpoint_equals_its_dequantized_weights(checkpoints):
    quant, plain = checkpoints
    prompts = [[5, 6, 7, 8], [40, 41, 300, 2, 9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    a = LLM(model=str(quant), **KW).generate(prompts, params, use_tqdm=False)
    b = LLM(model=str(plain), **KW).generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for tid, entry in lx.items():
                assert entry.logprob == pytest.approx(ly[tid].logprob, abs=1e-6)


def test_dequantize_matches_the_block_formula():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 70, generator=gen)
    q, scale = _quantize(w, BLOCK)
    out = fp8.dequantize(q, scale, BLOCK)
    for i, j in [(0, 0), (15, 31), (16, 32), (36, 69), (20, 64)]:
        want = q[i, j].float() * scale[i // BLOCK[0], j // BLOCK[1]]
        assert out[i, j].item() == pytest.approx(want.item(), rel=0, abs=0)
    assert (out - w).abs().max() < 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


def test_broken_pairs_and_other_quantizations_are_named():
    q = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"a\.weight has no scale"):
        list(fp8.dequantized_weights([("a.weight", q)], (2, 2)))
    with pytest.raises(ValueError, match=r"b\.weight_scale_inv has no weight"):
        list(fp8.dequantized_weights([("b.weight_scale_inv", torch.ones(2, 2))], (2, 2)))
    with pytest.raises(ValueError, match=r"c\.weight: scale shape \(1, 2\)"):
        list(
            fp8.dequantized_weights(
                [("c.weight", q), ("c.weight_scale_inv", torch.ones(1, 2))], (2, 2)
            )
        )

    class Config:
        quantization_config = {"quant_method": "awq", "bits": 4}

    with pytest.raises(ValueError, match="quant_method='awq'"):
        fp8.block_size(Config())
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert fp8.block_size(Config()) == (128, 128)
