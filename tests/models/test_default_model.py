"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers loading
the same GGUF file: greedy outputs of varied chat prompts must be identical (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from parity import eos_list, reference_agrees, reference_greedy
from prompts import QUESTIONS

from batchgen import SamplingParams
from batchgen.models.default_model import default_model_path

MAX_NEW = 40


@pytest.mark.slow  # ~30 s on 2 cores (transformers reads the GGUF): CI runs it in its slow step
def test_default_model_matches_transformers_on_the_same_gguf(default_model_llm):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    eos = default_model_llm.engine.eos_token_ids
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = default_model_llm.chat(
        convs, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False
    )
    mismatches = []
    for q, out in zip(QUESTIONS, outs):
        ours = list(out.outputs[0].token_ids)
        if not reference_agrees(ref, out.prompt_token_ids, ours, eos_list(eos), MAX_NEW):
            ref_tokens, _ = reference_greedy(ref, out.prompt_token_ids, MAX_NEW, eos=eos)
            mismatches.append((q, ours, ref_tokens))
    assert not mismatches, mismatches[:3]
    assert all(o.outputs[0].text for o in outs)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.slow  # ~1 s with the session's default-model engine, which the slow step builds
def test_default_model_stop_strings_and_logprobs(default_model_llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"], logprobs=3)
    out = default_model_llm.chat(
        [{"role": "user", "content": QUESTIONS[0]}], params, use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "Paris" not in out.text
    assert len(out.logprobs) == len(out.token_ids)
    for step, tok in zip(out.logprobs, out.token_ids):
        assert tok in step and len(step) >= 3
        assert all(lp.logprob <= 0 for lp in step.values())
