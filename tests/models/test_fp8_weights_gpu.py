"""An FP8 DeepSeek-V3 checkpoint on the GPU in bf16: weights held as stored, the W8A8
Triton GEMMs (dense and experts) inside the decode CUDA graphs, the graphs' rows equal to
the same engine run eagerly, and the kernels' run no farther from a float32 run of the
same W8A8 arithmetic than a torch run of that arithmetic in bf16 is.

Why that reference. W8A8 rounds every FP8 product's input rows onto e4m3 (1 x 128
groups: ~2.5% RMS relative error an element, ~16x bf16's), and a random tiny model's
logits are nearly flat (its top five within ~0.2 nats), so against the dequantized model
in float32 a W8A8 run collapses more rows than a bf16 run does (13 against 3 of 48 on an
H100): that is the precision, not the kernels. tests/w8a8_emulation.py rounds the same
inputs as kernels/fp8_quant.py defines (quantize_groups_reference) and multiplies them by
the dequantized weights in torch. In float32 (emulated32) it is the W8A8 model without
bf16's rounding; in bf16 (emulated16, eager, on the engine's Triton attention) it is the
graphs' run with torch products in place of the W8A8 kernels, whose float32 sums differ
from the kernels' only in the order (and, on FP8 tensor cores, the precision) of their
accumulation before the one rounding to bf16.

Not "about as far as bf16 from float32": e4m3 amplifies any difference. A bf16 value
near an e4m3 rounding boundary lands on the other side of it (a whole e4m3 step), and
the steps compound through the layers, so emulated16 is as far from emulated32 as W8A8
is from the float32 model. Measured with this checkpoint and these prompts on the CPU:
bf16 against float32 13 collapsed rows of 96, mean logprob drift (below) 0.016;
emulated32 against float32 23 and 0.098; emulated16 against emulated32 23 and 0.105;
eight runs of emulated16 with every float32 sum perturbed by 2^-14 relative (a stand-in
for the kernels' accumulation) against emulated32 19 to 27 rows and 0.099 to 0.113. So
the graphs and emulated16 are two draws of the same spread: the graphs may collapse at
most MARGIN rows more (12: three standard deviations of the difference of two such
draws), and drift at most DRIFT times as far (those eight: 0.94 to 1.08 times
emulated16's). Products 7% off gave 44 rows and 0.166 and fail both; a wrong scale,
layout or routing in a kernel moves every product it makes, and most rows. Rows rounded
toward zero (29 rows, 0.154) pass here: the kernels' tests hold that rounding bit for bit.

The drift: the mean |difference| of the logprobs two runs gave the token both chose,
over the steps before each row's first divergence (the same context on both sides):
hundreds of steps, so it moves far less by chance than a count of rows."""

from __future__ import annotations

import random

import pytest
import torch
from parity import collapsed, completions
from test_fp8_weights import SAVERS, write_fp8_pair
from w8a8_emulation import W8A8Emulation

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

KW = dict(device="cuda", page_size=16, max_model_len=512, max_num_seqs=48, num_kv_pages=1024)
MARGIN = 12  # rows of 96: chance between two runs of the same precision (module docstring)
DRIFT = 1.5  # the same for the mean logprob drift (module docstring)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    quant, _, _ = write_fp8_pair(
        tmp_path_factory.mktemp("fp8-gpu"), SAVERS["deepseek_v3"], reference=False
    )
    return str(quant)


def _prompts(n: int = 96) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 150))] for _ in range(n)]


def prefix_drift(rows, ref) -> float:
    """The mean |difference| between the logprobs two runs gave the tokens they both
    chose, over each row's steps before its first divergence (the same context on both
    sides); rows and ref: CompletionOutputs with logprobs."""
    diffs = []
    for a, b in zip(rows, ref, strict=True):
        for t, u, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if t != u:
                break
            diffs.append(abs(la[t].logprob - lb[t].logprob))
    assert diffs, "every row diverged at its first token"
    return sum(diffs) / len(diffs)


def test_fp8_decode_graphs_match_eager_and_the_emulated_w8a8_model(checkpoint, monkeypatch):
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)

    def rows(**kw):
        llm = LLM(model=checkpoint, **KW, **kw)
        return completions(llm, prompts, params), llm

    graphs, llm = rows(dtype="bfloat16")
    model = llm.engine.runner.model
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    eager, _ = rows(dtype="bfloat16", enforce_eager=True)
    assert collapsed(graphs, eager) == 0
    del llm, model

    emulation = W8A8Emulation(monkeypatch)  # the experts' loop reads offsets: eager runs
    emulated16, _ = rows(dtype="bfloat16", enforce_eager=True)
    assert emulation.linears and len(emulation.experts) == 2  # gate_up and down
    emulated32, _ = rows(dtype="float32", attention_backend="torch", enforce_eager=True)
    kernels, torch16 = collapsed(graphs, emulated32), collapsed(emulated16, emulated32)
    assert kernels <= torch16 + MARGIN, (kernels, torch16)
    drift, baseline = prefix_drift(graphs, emulated32), prefix_drift(emulated16, emulated32)
    assert drift <= DRIFT * baseline, (drift, baseline)
