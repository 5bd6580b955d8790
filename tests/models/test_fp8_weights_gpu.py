"""An FP8 DeepSeek-V3 checkpoint on the GPU in bf16: weights held as stored, the W8A8
Triton GEMMs (dense and experts) inside the decode CUDA graphs, the graphs' rows equal to
the same engine run eagerly, and the run judged with the bf16 run of the same weights
dequantized against the float32 run of those (the logprob-closeness rule; activations
quantized in 1 x 128 groups may cost a few near-ties more than bf16 rounding does)."""

from __future__ import annotations

import random

import pytest
import torch
from parity import collapsed, completions
from test_fp8_weights import SAVERS, write_fp8_pair

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

KW = dict(device="cuda", page_size=16, max_model_len=512, max_num_seqs=48, num_kv_pages=1024)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    quant, plain, _ = write_fp8_pair(
        tmp_path_factory.mktemp("fp8-gpu"), SAVERS["deepseek_v3"], reference=False
    )
    return str(quant), str(plain)


def _prompts(n: int = 48) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 150))] for _ in range(n)]


def test_fp8_decode_graphs_match_eager_and_the_dequantized_model(checkpoints):
    quant, plain = checkpoints
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)

    def rows(model, **kw):
        llm = LLM(model=model, **KW, **kw)
        return completions(llm, prompts, params), llm

    graphs, llm = rows(quant, dtype="bfloat16")
    model = llm.engine.runner.model
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    eager, _ = rows(quant, dtype="bfloat16", enforce_eager=True)
    assert collapsed(graphs, eager) == 0
    ref32, _ = rows(plain, dtype="float32", attention_backend="torch")
    bf16, _ = rows(plain, dtype="bfloat16")
    assert collapsed(graphs, ref32) <= collapsed(bf16, ref32) + 4
