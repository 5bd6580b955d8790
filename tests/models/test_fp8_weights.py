"""Block-scaled FP8 checkpoints in the real on-disk format (float8_e4m3fn weights beside
`weight_scale_inv`, 128 x 128 blocks, config.json's quantization_config) load with their
weights still FP8, and generate what transformers generates from the same checkpoint
(which it dequantizes to float32 on the CPU): greedy tokens identical, logprobs within
1e-4 (CPU, float32: each tile of a weight dequantized as it is multiplied)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import save_tiny_model
from deepseek_checkpoints import save_tiny_deepseek
from fp8_blocks import quantize_blocks
from kimi_checkpoints import save_tiny_kimi
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import MAX_NEW, RUN, Reference, _prompts

from batchgen import LLM, SamplingParams
from batchgen.layers.linear import Linear
from batchgen.layers.routed_experts import RoutedExperts
from batchgen.models import fp8
from batchgen.models.loader import ModelSource, build_model

BLOCK = (128, 128)
EXPERT = re.compile(r"experts\.\d+\.w[123]\.weight$")
# block-aligned shapes: stacked shards (q | k | v, gate | up) start on a 128-row block
LLAMA = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
             intermediate_size=384)  # fmt: skip
# v_head_dim 16: kv_b_proj's 4 x (16 + 16) rows are one whole block; transformers 5.25
# reads a weight whose last row block is partial, past the first, with other scales
# than the checkpoint format's W[i, j] * scale[i // 128, j // 128]
DEEPSEEK = dict(
    first_k_dense_replace=1, intermediate_size=256, moe_intermediate_size=128, v_head_dim=16
)


def is_quantized_by_converter(name: str) -> bool:
    """The weights DeepSeek's FP8 converter stores in FP8: every projection (attention,
    dense MLPs, shared and routed experts: Kimi Linear's w1 / w2 / w3), not the
    embeddings, lm_head, norms, convolution taps or router."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight")) or bool(EXPERT.search(name))


def write_fp8_pair(base, save, reference: bool = True) -> tuple:
    """(fp8 dir, float32 dir of the same weights dequantized, transformers' model read
    from the FP8 dir: on the CPU it dequantizes the pairs itself, into float32; None
    without `reference`)."""
    quant, plain = base / "fp8", base / "plain"
    save(quant)
    fp8_tensors, dequantized = {}, {}
    for name, t in load_file(str(quant / "model.safetensors")).items():
        if is_quantized_by_converter(name):
            q, scale = quantize_blocks(t.float(), BLOCK)
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = fp8.dequantize(q, scale, BLOCK).contiguous()
        else:
            fp8_tensors[name] = dequantized[name] = t
    save_file(fp8_tensors, str(quant / "model.safetensors"))
    save(plain)
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (quant / "config.json").write_text(json.dumps(config))
    if not reference:
        return quant, plain, None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(quant), dtype=torch.float32)
    return quant, plain, model.eval()


KIMI = dict(DEEPSEEK, layer_types=["linear_attention", "full_attention"], linear_head_dim=64)
SAVERS = {
    "llama": lambda d: save_tiny_model(d, "LlamaForCausalLM", **LLAMA),
    "deepseek_v3": lambda d: save_tiny_deepseek(d, **DEEPSEEK),
    "kimi_linear": lambda d: save_tiny_kimi(d, **KIMI),
}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def checkpoint(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    quant, plain, reference = write_fp8_pair(base, SAVERS[request.param])
    prompts = _prompts(8)
    return request.param, quant, prompts, Reference(reference, quant, prompts), plain


def test_weights_stay_fp8_as_stored(checkpoint):
    """Every FP8 weight is held as stored, the routed experts' too: one byte a weight,
    the checkpoint's scales beside it, a stacked layer's shards each in their own
    blocks (Kimi Linear's KDA in_proj: its 2-row beta shard puts f_a inside a block);
    dequantized is only MLA's kv_b_proj (its matrix is read by the absorbed decode)."""
    arch, quant, *_ = checkpoint
    source = ModelSource.resolve(quant)
    config = source.load_config()
    model = build_model(source, config, torch.float32, torch.device("cpu"), 64)
    stored = load_file(str(quant / "model.safetensors"))
    kept = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or name.endswith("conv1d"):
            continue  # KDA's convolution taps: stored in float, as every non-projection
        if name.endswith("kv_b_proj") or name == "lm_head":
            assert layer.weight.dtype == torch.float32, name
            continue
        assert layer.weight.dtype == torch.float8_e4m3fn, name
        assert layer.weight.nbytes == layer.weight.numel() == layer.out_features * layer.in_features
        assert layer.weight_scale_inv.dtype == torch.float32
        if not layer.shards and f"model.{name}.weight" in stored:
            want = stored[f"model.{name}.weight"]
            assert torch.equal(layer.weight.view(torch.uint8), want.view(torch.uint8)), name
            assert torch.equal(layer.weight_scale_inv, stored[f"model.{name}.weight_scale_inv"])
        kept += 1
    assert kept >= {"llama": 6, "deepseek_v3": 11, "kimi_linear": 11}[arch]
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == {"llama": 0, "deepseek_v3": 1, "kimi_linear": 1}[arch]
    for layer in experts:
        i = next(n for n, m in model.named_modules() if m is layer).split(".")[1]
        for e in (0, layer.num_experts - 1):
            up, down = (  # DeepSeek-V3's names, or Kimi Linear's w3 / w2
                next(
                    t
                    for n, t in stored.items()
                    if re.search(rf"layers\.{i}\..*experts\.{e}\.{p}$", n)
                )
                for p in (r"(up_proj|w3)\.weight", r"(down_proj|w2)\.weight_scale_inv")
            )
            assert torch.equal(
                layer.gate_up_proj[e, layer.inter :].view(torch.uint8), up.view(torch.uint8)
            )
            assert torch.equal(layer.down_proj_scale_inv[e], down)
        assert layer.down_proj.dtype == torch.float8_e4m3fn
        assert layer.gate_up_proj.nbytes == layer.gate_up_proj.numel()


def test_greedy_equals_the_dequantized_model_in_the_default_configuration(checkpoint):
    """The default configuration (pipelined decode, EOS endings): tokens and finish
    reasons equal transformers' on the same checkpoint."""
    _, quant, prompts, ref, _ = checkpoint
    llm = LLM(model=str(quant), num_kv_pages=64, **RUN)
    ref.check(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW)))


def test_logprobs_within_1e_4_of_the_dequantized_model(checkpoint):
    _, quant, prompts, ref, _ = checkpoint
    llm = LLM(model=str(quant), num_kv_pages=64, **RUN)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    worst = ref.check(llm.generate(prompts, params, use_tqdm=False), logprobs=True)
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


# the checkpoint's FP8 weights the model dequantizes (test_weights_stay_fp8_as_stored)
DEQUANTIZED = re.compile("kv_b_proj")
# the parts of Kimi Linear's KDA in_proj, whose stacked shards start inside blocks
KDA_IN_PROJ = re.compile(r"layers\.0\.self_attn\.(q|k|v|b|f_a|g_a)_proj\.weight$")


def test_weight_bytes_count_one_byte_a_kept_weight_and_its_scales(checkpoint):
    """engine.metrics()["weight_bytes"]: the float32 model's bytes less 3 a weight kept
    FP8, plus its float32 scales (every FP8 weight of the checkpoint but MLA's
    kv_b_proj), plus an int32 a row of a stacked layer whose shards start inside blocks
    (its rows' scale row index: Kimi Linear's KDA in_proj)."""
    arch, quant, _, _, plain = checkpoint
    fp8_bytes = LLM(model=str(quant), num_kv_pages=32, **RUN).engine.metrics()["weight_bytes"]
    float_bytes = LLM(model=str(plain), num_kv_pages=32, **RUN).engine.metrics()["weight_bytes"]
    saved = 0
    for name, t in load_file(str(quant / "model.safetensors")).items():
        if DEQUANTIZED.search(name):
            continue
        if t.dtype == torch.float8_e4m3fn:
            saved += 3 * t.numel()
        elif name.endswith("_scale_inv"):
            saved -= t.nbytes
        if arch == "kimi_linear" and KDA_IN_PROJ.search(name):
            saved -= 4 * t.shape[0]
    assert saved > 0 and fp8_bytes == float_bytes - saved


def test_deterministic_rows_are_the_same_bits_alone_and_in_a_batch(checkpoint):
    """deterministic=True with FP8 weights (dense tiles and experts dequantized in turn,
    every product batch-invariant): a prompt's logprobs alone equal its logprobs among
    the batch's prompts."""
    _, quant, prompts, _, _ = checkpoint
    llm = LLM(model=str(quant), num_kv_pages=64, deterministic=True, **RUN)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 5):
        alone = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0]
        got = batch[i].outputs[0]
        assert alone.token_ids == got.token_ids
        assert [lp[t].logprob for t, lp in zip(alone.token_ids, alone.logprobs)] == [
            lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)
        ]
