"""Kimi Linear's state tier in the configuration users run, CPU fp32: tier_policy left at
"auto" (the cost rule chooses loading), debug off, no logprobs (decode pipelined), EOS
endings, a pool too small for the batch (pages and state slots swap) and prompts sharing
prefixes (state checkpoints serve prefix hits), all in one run; greedy tokens and finish
reasons identical to a tier-off run on an ample pool (no preemption, no prefix hits).
tests/models/test_kimi_linear_swap.py and test_kimi_linear_prefix.py test the two
mechanisms apart under tier_policy="always"."""

from __future__ import annotations

import pytest
from conftest import record_launches
from test_deepseek_v3 import Reference
from test_kimi_linear import (
    PATTERNS,
    RUN,
    save_tiny_kimi,
    transformers_torch_path,  # noqa: F401 (autouse: torch KDA)
)
from test_kimi_linear_prefix import _prompts

from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOKENS = SamplingParams(temperature=0, max_tokens=16)
SMALL = dict(RUN, max_model_len=160, num_kv_pages=40, max_num_batched_tokens=48)
TIER = dict(host_kv_size_gib=0.01, state_checkpoint_interval=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint (EOS set to a token the greedy runs emit), its prompts (three
    groups of three sharing 37 tokens, one of its own) and the tier-off ample run's
    (tokens, finish reason) per prompt."""
    path = tmp_path_factory.mktemp("kimi-linear-tier-defaults")
    prompts = _prompts()
    Reference(save_tiny_kimi(path, **PATTERNS["kda3_mla1"]), path, prompts)
    plain = LLM(model=str(path), **{**SMALL, "num_kv_pages": 400})
    ref = _rows(plain.generate(prompts, TOKENS, use_tqdm=False))
    m = plain.engine.metrics()
    assert m["preemptions"] == 0 and m["prefix_hit_tokens"] == 0, m
    assert {r for _, r in ref} == {"stop", "length"}, ref
    return str(path), prompts, ref


def _rows(outs) -> list[tuple[list[int], str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_swaps_and_checkpoint_hits_in_the_default_configuration(model):
    path, prompts, ref = model
    llm = LLM(model=path, **TIER, **SMALL)
    assert llm.config.tier_policy == "auto" and not llm.config.batchgen_debug
    launches = record_launches(llm.engine.runner)
    first = _rows(llm.generate(prompts, TOKENS, use_tqdm=False))
    m = llm.engine.metrics()
    second = _rows(llm.generate(prompts, TOKENS, use_tqdm=False))
    again = llm.engine.metrics()
    bad = [i for i, (a, b) in enumerate(zip(first, ref)) if a != b]
    assert not bad, f"first call, rows {bad}"
    bad = [i for i, (a, b) in enumerate(zip(second, ref)) if a != b]
    assert not bad, f"second call, rows {bad}"
    assert m["tier_loads_pay"], m  # the cost rule chose loading over recomputing
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] == m["state_swaps_out"], m
    assert m["state_checkpoint_hit_tokens"] > 0 and m["recomputes"] == 0, m
    assert again["state_checkpoint_hit_tokens"] > m["state_checkpoint_hit_tokens"], again
    assert m["readback_checks"] == 0, m
    assert any(behind for _, behind in launches), "no decode step was queued ahead"
    assert llm.engine.tier.num_in_flight == 0
