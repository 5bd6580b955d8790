"""deterministic=True with expert parallel (CPU, gloo, float32, a tiny DeepSeek-V3 of
Kimi-K2's shape: MLA, a dense layer, then routed and shared experts): the combine adds a
token's expert rows in its routing order whichever rank computed them, so 2 tensor-parallel
ranks with expert parallel (and without it: the experts' shares all-reduced in rank
order) give each prompt the same tokens and logprobs alone, batched and chunked, and
attention data parallel over 2 ranks gives one engine's bits."""

from __future__ import annotations

import pytest
from conftest import save_random_model
from deepseek_checkpoints import CONFIGS
from deepseek_checkpoints import tiny_config as deepseek_config
from deterministic_cases import mixed_params, mixed_prompts, probe_rows

from batchgen import LLM

NUM_PROMPTS = 16
PROBES = range(0, NUM_PROMPTS, 4)
EP = dict(enable_expert_parallel=True)


@pytest.fixture(scope="module")
def deepseek_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    save_random_model(path, deepseek_config(**CONFIGS["moe_kimi_like"]))
    return str(path)


def _rows(model: str, alone: bool = False, **kw) -> list[tuple]:
    """The PROBES prompts' rows, deterministic: each prompt in an engine call of its own,
    or all NUM_PROMPTS in one call."""
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=256, deterministic=True, **kw)
    try:
        prompts, params = mixed_prompts(7, NUM_PROMPTS), mixed_params(NUM_PROMPTS, 12)
        return probe_rows(llm, prompts, params, PROBES, alone)
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
