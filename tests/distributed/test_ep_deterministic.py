"""deterministic=True with expert parallel (CPU, gloo, float32, a tiny DeepSeek-V3 of
Kimi-K2's shape: MLA, a dense layer, then routed and shared experts): the combine adds a
token's expert rows in its routing order whichever rank computed them, so 2 tensor-parallel
ranks with expert parallel (and without it: the experts' shares all-reduced in rank
order) give each prompt the same tokens and logprobs alone, batched and chunked, and
attention data parallel over 2 ranks gives one engine's bits."""

from __future__ import annotations

import random

import pytest
from conftest import save_random_model
from deepseek_checkpoints import CONFIGS
from deepseek_checkpoints import tiny_config as deepseek_config

from batchgen import LLM, SamplingParams

NUM_PROMPTS = 16
PROBES = range(0, NUM_PROMPTS, 4)
EP = dict(enable_expert_parallel=True)


@pytest.fixture(scope="module")
def deepseek_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    save_random_model(path, deepseek_config(**CONFIGS["moe_kimi_like"]))
    return str(path)


def _prompts() -> list[list[int]]:
    """Mixed lengths (2-150 tokens); every fourth starts with the same 40 tokens."""
    rng = random.Random(7)
    shared = [rng.randint(3, 500) for _ in range(40)]
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(2, 150))] for _ in range(16)]
    return [shared + p[:30] if i % 4 == 0 else p for i, p in enumerate(prompts)]


def _params() -> list[SamplingParams]:
    lp = dict(max_tokens=12, logprobs=0)  # off-defaults: the logprobs are compared too
    return [
        SamplingParams(temperature=0, **lp)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, **lp)
        for i in range(NUM_PROMPTS)
    ]


def _row(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, c.finish_reason, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def _rows(model: str, alone: bool = False, **kw) -> list[tuple]:
    """The PROBES prompts' rows, deterministic: each prompt in an engine call of its own,
    or all NUM_PROMPTS in one call."""
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=256, deterministic=True, **kw)
    try:
        prompts, params = _prompts(), _params()
        if alone:
            return [_row(llm.generate([prompts[i]], params[i], use_tqdm=False)[0]) for i in PROBES]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [_row(outs[i]) for i in PROBES]
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_tp2_moe_rows_are_the_same_alone_batched_and_chunked(deepseek_moe, expert_parallel):
    """With expert parallel a decode step of one row leaves one rank no tokens of the
    slice: it still runs. Without it each rank computes its experts' share of every
    token and the shares are all-reduced (in rank order)."""
    kw = dict(tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    alone = _rows(deepseek_moe, alone=True, **kw)
    assert len(alone) == len(PROBES) and all(len(r[0]) > 0 for r in alone)
    assert _rows(deepseek_moe, **kw) == alone
    assert _rows(deepseek_moe, max_num_batched_tokens=64, **kw) == alone


@pytest.mark.slow
def test_attention_data_parallel_2_equals_one_engine(deepseek_moe):
    one = _rows(deepseek_moe)
    assert _rows(deepseek_moe, data_parallel_size=2, **EP) == one
