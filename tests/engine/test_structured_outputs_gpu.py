"""Structured outputs on the GPU in the default configuration: bf16, Triton attention,
decode CUDA graphs, pipelined decode with deferred sampling. Every answer ends by EOS
and validates; the device-side mask equals xgrammar's own CUDA kernel."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr
from batch_cases import SCHEMA
from conftest import record_launches, save_byte_tokenizer, save_tiny_model

from batchgen import LLM, SamplingParams, StructuredOutputsParams
from batchgen.runner.sampler import apply_token_bitmask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured_gpu")
    save_tiny_model(path, "LlamaForCausalLM")
    save_byte_tokenizer(path)
    return path


def test_json_schema_in_the_default_gpu_configuration(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=256, num_kv_pages=2048)
    engine = llm.engine
    assert engine.device.type == "cuda" and engine.runner.graphs is not None
    launches = record_launches(engine.runner)
    prompts = [[5 + i % 200, 40 + (7 * i) % 300, 7] for i in range(128)]
    spec = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, max_tokens=200, structured_outputs=spec),
        use_tqdm=False,
    )
    assert any(flight.deferred for flight, _ in launches), "no step deferred its sampling"
    assert engine.runner.graphs.graphs, "no decode step was replayed from a CUDA graph"
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(engine.grammar) == 0


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (256, 151936)])
def test_device_mask_equals_xgrammars_cuda_kernel(rows, vocab):
    gen = torch.Generator(device="cuda").manual_seed(0)
    words = torch.randint(
        -(2**31), 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, device="cuda",
        generator=gen,
    )  # fmt: skip
    logits = torch.randn(rows, vocab, device="cuda", generator=gen)
    ours = apply_token_bitmask(logits.clone(), words)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])
