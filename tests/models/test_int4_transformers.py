"""INT4 pack-quantized checkpoints against transformers reading the same files itself
(through compressed-tensors, which it asks to dequantize them): greedy tokens identical,
logprobs within 1e-4 (CPU, float32).

compressed-tensors dequantizes into the scales' dtype (bfloat16), rounding q * scale;
the engine computes it exactly in float32. The checkpoints here therefore hold scales
that are powers of two, so that every q * scale is a bfloat16 value and both read the
same weights; transformers keeps the routed experts it dequantizes in bfloat16, which the
reference widens back to float32 (exactly) so that both compute in float32."""

from __future__ import annotations

import pytest
import torch
from int4_blocks import TINY_INT4, write_pack_quantized
from parity import reference_greedy

from batchgen import LLM, SamplingParams

MAX_NEW = 8
RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=128, max_num_seqs=8)
PROMPTS = [[5, 6, 7, 8], [40, 41, 300, 2, 9, 10, 11], [100 + i for i in range(30)]]
MODELS = TINY_INT4


@pytest.mark.parametrize("name", list(MODELS))
def test_int4_checkpoint_matches_transformers_reading_it(tmp_path, name):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    save, packs, ignore = MODELS[name]
    plain = tmp_path / "plain"
    plain.mkdir()
    for d in (tmp_path, plain):
        save(d)
    assert write_pack_quantized(tmp_path, plain, packs, 32, ignore, pow2_scales=True) > 0
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path),
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    )
    reference = reference.float().eval()  # it leaves dequantized experts in bfloat16
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = LLM(model=str(tmp_path), **RUN).generate(PROMPTS, params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = reference_greedy(reference, prompt, MAX_NEW, eos=None)
        assert out.outputs[0].token_ids == tokens
        for step, tok in enumerate(tokens):
            got = out.outputs[0].logprobs[step][tok].logprob
            worst = max(worst, abs(got - logprobs[step][tok].item()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
