"""vLLM compatibility of the LLM object: get_tokenizer() and trust_remote_code."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, num_kv_pages=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compat")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def test_get_tokenizer_is_the_engines(model_dir):
    llm = LLM(model=str(model_dir), **KW)
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    ids = tok.encode("w5 w6 w7", add_special_tokens=False)
    assert ids == [5, 6, 7]
    out = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert tok.decode(out[0].outputs[0].token_ids) == out[0].outputs[0].text


@pytest.mark.parametrize("trust", [True, False])
def test_trust_remote_code_is_accepted(model_dir, trust):
    llm = LLM(model=str(model_dir), trust_remote_code=trust, **KW)
    assert "trust_remote_code" not in vars(llm.config)
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_trust_remote_code_must_be_a_bool(model_dir):
    with pytest.raises(TypeError, match="trust_remote_code must be a bool"):
        LLM(model=str(model_dir), trust_remote_code="yes", **KW)
