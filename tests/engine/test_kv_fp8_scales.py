"""FP8 KV pages with a checkpoint's KV scales (layers/kv_scales.py) end to end on the CPU.

The tiny Qwen3 and DeepSeek-V3 checkpoints are rewritten so that K and V (MLA: the
latent) run about 1000 times FP8's largest value while the model computes the same
function: Qwen3's k_norm and v_proj grow by BIG, q_norm and o_proj shrink by it;
DeepSeek-V3's kv_a_layernorm and the rope rows of kv_a_proj_with_mqa grow, kv_b_proj
and the rope rows of q_b_proj shrink. Their KV scales, under each name the formats use
(compressed-tensors' k_scale/v_scale, ModelOpt's k_proj.k_scale/v_proj.v_scale,
AutoFP8's kv_scale; per tensor and per head), bring them back into e4m3's range:
- with them, no greedy row of an FP8-KV run collapses under the logprob-closeness rule
  against the same checkpoint with float32 KV (which ignores the scales);
- without them (the same checkpoint, its scales dropped: 1.0) K and V saturate at 448
  and rows collapse: the scales are what keeps the run close;
- a malformed scale is a ValueError naming the tensor.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from conftest import save_tiny_model
from gpu_defaults import collapsed_rows
from kv_scale_checkpoints import grown_deepseek, grown_qwen3, write_weights
from parity import completions
from safetensors.torch import load_file

from batchgen import LLM, SamplingParams

RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, num_kv_pages=200)
JUDGE = SamplingParams(temperature=0, max_tokens=12, logprobs=5)  # off-defaults: judge
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 20))] for _ in range(8)]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def checkpoints(request, tmp_path_factory):
    """(with scales, without them): the same grown weights."""
    scaled = tmp_path_factory.mktemp(f"kv-scales-{request.param}")
    tensors, scales = (grown_qwen3 if request.param == "qwen3" else grown_deepseek)(scaled)
    plain = tmp_path_factory.mktemp(f"kv-noscales-{request.param}")
    shutil.copytree(scaled, plain, dirs_exist_ok=True)
    write_weights(plain, tensors)
    write_weights(scaled, {**tensors, **scales})
    return str(scaled), str(plain)


def test_checkpoint_kv_scales_keep_fp8_pages_close_to_float32_kv(checkpoints):
    scaled, plain = checkpoints
    prompts = _prompts()
    ref_llm = LLM(scaled, **RUN)
    ref = completions(ref_llm, prompts, JUDGE)
    eos = ref_llm.engine.eos_token_ids
    llm = LLM(scaled, kv_cache_dtype="fp8", **RUN)
    outs = completions(llm, prompts, GREEDY)
    bad = collapsed_rows(llm, prompts, outs, ref, eos)
    assert not bad, f"rows {bad} collapsed against float32 KV with the checkpoint's scales"
    unscaled = LLM(plain, kv_cache_dtype="fp8", **RUN)
    outs = completions(unscaled, prompts, GREEDY)
    assert collapsed_rows(unscaled, prompts, outs, ref, eos), "K/V never left FP8's range"


@pytest.mark.parametrize(
    "scale, message",
    [
        (torch.tensor([1.0, 2.0, 3.0]), "1 value"),
        (torch.ones(2, 2), "1 value"),
        (torch.tensor(0.0), "above 0"),
        (torch.tensor(float("nan")), "finite"),
    ],
)
def test_a_malformed_kv_scale_names_the_tensor(tmp_path, scale, message):
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.v_scale"
    write_weights(tmp_path, {**tensors, name: scale})
    with pytest.raises(ValueError, match=message) as err:
        LLM(str(tmp_path), kv_cache_dtype="fp8", **RUN)
    assert name in str(err.value)
