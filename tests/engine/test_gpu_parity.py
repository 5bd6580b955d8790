"""GPU parity in bf16 with the torch attention backend, under the logprob-closeness rule."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ARCHS, save_tiny_model
from parity import close_under_top5, reference_finish, reference_greedy
from prompts import QUESTIONS

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(n: int = 16) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randint(3, 500) for _ in range(40)]
    return [
        (shared if i % 2 else []) + [rng.randint(3, 500) for _ in range(rng.randint(5, 90))]
        for i in range(n)
    ]


def _count_rows(llm, ref, prompts, max_new, eos):
    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=5, ignore_eos=eos is None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    identical = close = 0
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        ref_tokens, ref_lps = reference_greedy(ref, prompt, max_new, eos=eos)
        if c.token_ids == ref_tokens and c.finish_reason == reference_finish(ref_tokens, eos):
            identical += 1
        elif close_under_top5(c, ref_tokens, ref_lps, eos):
            close += 1
    return identical, close, len(prompts)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_tiny_models_match_transformers(tmp_path, arch, backend):
    ref = save_tiny_model(tmp_path, arch).to("cuda", torch.bfloat16)
    llm = LLM(
        attention_backend=backend,
        model=str(tmp_path),
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        num_kv_pages=64,
        max_num_batched_tokens=128,
        max_model_len=256,
    )
    identical, close, total = _count_rows(llm, ref, _prompts(), 16, None)
    print(f"{arch}/{backend}: {identical} identical, {close} close, {total} rows")
    assert identical + close == total
    assert llm.engine.scheduler.num_preemptions > 0 or llm.engine.kv.prefix_hit_tokens > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_default_model_matches_transformers(backend):
    from transformers import AutoModelForCausalLM

    from batchgen.models.default_model import default_model_path

    path = default_model_path()
    ref = (
        AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
        )
        .to("cuda")
        .eval()
    )
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=1024, attention_backend=backend)
    prompts = [
        llm.tokenizer.encode(
            llm.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        for q in QUESTIONS
    ]
    identical, close, total = _count_rows(llm, ref, prompts, 40, llm.engine.eos_token_ids)
    print(f"default model/{backend}: {identical} identical, {close} close, {total} rows")
    assert identical + close == total
