"""Quantized weights in the configuration users run: block-scaled FP8 (128 x 128) and
pack-quantized INT4 (g32) Llama checkpoints with the host tier, pipelined decode and
structured outputs at their defaults (EOS endings, no logprobs, debug off), each
against the same weights dequantized into a float32 checkpoint.

- A pool too small for the batch swaps pages through the host tier while decode steps
  queue ahead: greedy rows equal the dequantized model's on an ample pool, seeded
  sampled rows equal the quantized model's own on an ample pool.
- Greedy JSON-schema outputs validate and equal the dequantized model's.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from batch_cases import SCHEMA, greedy_and_sampled, prefix_prompts
from conftest import record_launches, save_byte_tokenizer, save_tiny_model
from int4_blocks import write_pack_quantized
from penalty_reference import emitted_eos, set_eos
from test_fp8_weights import LLAMA, write_fp8_pair

from batchgen import LLM, SamplingParams, StructuredOutputsParams

RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, max_num_seqs=8)
MAX_NEW = 16


def _prompts() -> list[list[int]]:
    return prefix_prompts(12, 250)


def _save(path) -> None:
    save_tiny_model(path, "LlamaForCausalLM", **LLAMA)
    save_byte_tokenizer(path)  # every string encodes: the grammar can write any JSON


@pytest.fixture(scope="module", params=["fp8", "int4"])
def checkpoints(request, tmp_path_factory):
    """{"quant", "plain"}: the quantized dir and the dequantized float32 one, their EOS
    the tokenizer's </s>; "quant_eos", "plain_eos": copies whose EOS is a token the runs
    emit mid-way, so that rows end both ways."""
    base = tmp_path_factory.mktemp(f"defaults-{request.param}")
    if request.param == "fp8":
        quant, plain, _ = write_fp8_pair(base, _save, reference=False)
    else:
        quant, plain = base / "int4", base / "plain"
        for d in (quant, plain):
            d.mkdir()
            _save(d)
        assert write_pack_quantized(quant, plain, lambda n: "proj" in n, 32) > 0
    free = LLM(str(plain), num_kv_pages=400, **RUN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    runs = [list(o.outputs[0].token_ids) for o in free.generate(_prompts(), greedy)]
    eos = emitted_eos(runs)
    dirs = {"quant": quant, "plain": plain}
    for name, d in list(dirs.items()):
        dirs[name + "_eos"] = shutil.copytree(d, base / f"{name}_eos")
        set_eos(dirs[name + "_eos"], eos)
    return {name: str(d) for name, d in dirs.items()}


def _tokens(outs) -> list[tuple[list[int], str]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def test_host_tier_and_pipelined_decode_with_quantized_weights(checkpoints):
    quant, plain = checkpoints["quant_eos"], checkpoints["plain_eos"]
    prompts, params = _prompts(), greedy_and_sampled(12, MAX_NEW)
    ref = _tokens(LLM(plain, num_kv_pages=400, **RUN).generate(prompts, params))
    ample = _tokens(LLM(quant, num_kv_pages=400, **RUN).generate(prompts, params))
    tight = LLM(quant, num_kv_pages=20, host_kv_size_gib=0.01, **RUN)
    assert tight.config.tier_policy == "auto" and not tight.config.batchgen_debug
    launches = record_launches(tight.engine.runner)
    got = _tokens(tight.generate(prompts, params))
    m = tight.engine.metrics()
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0 and m["recomputes"] == 0, m
    assert any(behind for _, behind in launches), "no decode step was queued ahead"
    assert {reason for _, reason in got} == {"stop", "length"}
    for i, p in enumerate(params):
        want = ref[i] if p.temperature == 0 else ample[i]
        assert got[i] == want, f"row {i} ({'greedy' if p.temperature == 0 else 'sampled'})"


def test_structured_outputs_with_quantized_weights(checkpoints):
    quant, plain = checkpoints["quant"], checkpoints["plain"]
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    prompts = [[5 + i, 40 + 3 * i, 7] for i in range(8)]
    rows = {}
    for name, path in (("quant", quant), ("plain", plain)):
        outs = LLM(path, num_kv_pages=200, **RUN).generate(prompts, params)
        rows[name] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    for text, reason in rows["quant"]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert rows["quant"] == rows["plain"]
