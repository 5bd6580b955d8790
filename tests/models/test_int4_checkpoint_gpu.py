"""INT4 pack-quantized checkpoints on the GPU, bf16, decode CUDA graphs: the W4A16 GEMMs
and the INT4 expert GEMMs against the same weights dequantized (a plain checkpoint, whose
bf16 weights round q * scale as the kernels do), under the logprob-closeness rule, both
judged by the float32 run of the dequantized weights. Only the GEMMs differ; a bf16 MoE
may flip an expert choice at a near-tie in either run, so INT4 may collapse at most 2
rows more than plain bf16 of 48."""

from __future__ import annotations

import random

import pytest
from int4_blocks import TINY_INT4, write_pack_quantized
from parity import collapsed, completions

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

KW = dict(device="cuda", page_size=16, max_model_len=512, max_num_seqs=48)
MODELS = TINY_INT4


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 150))] for _ in range(n)]


@pytest.mark.parametrize("name", list(MODELS))
def test_int4_bf16_with_graphs_is_as_close_as_its_dequantized_weights(tmp_path, name):
    save, packs, ignore = MODELS[name]
    plain = tmp_path / "plain"
    plain.mkdir()
    for d in (tmp_path, plain):
        save(d)
    write_pack_quantized(tmp_path, plain, packs, 32, ignore)
    prompts = _prompts(48)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    judge = completions(LLM(model=str(plain), dtype="float32", **KW), prompts, params)
    bf16 = completions(LLM(model=str(plain), dtype="bfloat16", **KW), prompts, params)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", **KW)
    int4 = completions(llm, prompts, params)
    assert collapsed(int4, judge) <= collapsed(bf16, judge) + 2
    packed = [p for n, p in llm.engine.runner.model.named_parameters() if n.endswith("_packed")]
    assert packed and all(p.is_cuda for p in packed)
