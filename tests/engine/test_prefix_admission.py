"""Prefix admission end to end on the CPU: a round-robin batch of shared prefixes computes
far fewer tokens than in arrival order, with the same greedy outputs per request."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

KW = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_model_len=96,
    max_num_batched_tokens=64,
    num_kv_pages=40,  # about 3 requests: every prefix is evicted before its turn comes again
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path, "LlamaForCausalLM")
    return str(path)


def _round_robin(num_prefixes=4, questions=4, prefix_len=40, question_len=6, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randint(3, 500) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        p + [rng.randint(3, 500) for _ in range(question_len)]
        for _ in range(questions)
        for p in prefixes
    ]


def _generate(model_dir, prompts, params, admission, **kw):
    llm = LLM(model=model_dir, admission=admission, **{**KW, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.metrics()


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_prefix_admission_computes_each_prefix_once_with_the_same_outputs(model_dir, ignore_eos):
    prompts = _round_robin()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=ignore_eos)
    by_prefix, m_prefix = _generate(model_dir, prompts, params, "prefix")
    by_arrival, m_arrival = _generate(model_dir, prompts, params, "arrival")
    assert by_prefix == by_arrival
    prompt_tokens = sum(map(len, prompts))
    # arrival order: each prefix is evicted before the next request sharing it arrives
    assert m_arrival["prefix_hit_tokens"] < prompt_tokens // 10
    # prefix order: each 40-token prefix is computed about once (10 pages, 12 followers)
    assert m_prefix["prefix_hit_tokens"] >= 12 * 40 * 3 // 4
    # 16 x 8 output tokens and 16 x 6 question tokens are computed either way
    assert m_prefix["computed_tokens"] < m_arrival["computed_tokens"] * 0.6
    assert m_prefix["prompt_tokens"] == m_arrival["prompt_tokens"] == prompt_tokens


def test_prefix_admission_matches_with_pipelined_decode_off_and_a_roomy_pool(model_dir):
    prompts = _round_robin(seed=1)
    params = SamplingParams(temperature=0, max_tokens=8)
    ref, _ = _generate(model_dir, prompts, params, "arrival", num_kv_pages=400)
    got, m = _generate(model_dir, prompts, params, "prefix", pipeline_decode=False)
    assert got == ref
    assert m["computed_tokens"] < sum(map(len, prompts))
