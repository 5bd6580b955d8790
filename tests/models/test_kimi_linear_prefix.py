"""Kimi Linear prefix hits from state checkpoints (host tier on): requests sharing a
long prompt prefix resume from the KDA state copied to host at a checkpoint position,
with the prefix's pages from the cache, instead of computing the prefix again.

CPU fp32, tiny random checkpoint, the engine's default configuration (pipelined decode,
EOS endings, prefix admission) unless a test says otherwise; each run compared with the
same prompts on a tier-off engine (no prefix caching for hybrids there): greedy tokens
and finish reasons identical, logprobs within 1e-4 (the prefix is computed in other
chunks there).
"""

from __future__ import annotations

import random

import pytest
from test_deepseek_v3 import Reference
from test_kimi_linear import (
    PATTERNS,
    RUN,
    save_tiny_kimi,
    transformers_torch_path,  # noqa: F401 (autouse: torch KDA)
)

from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOKENS = SamplingParams(temperature=0, max_tokens=16)  # pipelinable: no logprobs
LOGPROBS = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
INTERVAL = 8  # two pages of 4
TIER = dict(host_kv_size_gib=0.01, tier_policy="always", state_checkpoint_interval=INTERVAL)
POOL = dict(num_kv_pages=400, max_num_batched_tokens=48, **RUN)


def _prompts() -> list[list[int]]:
    """Three groups of three prompts: a shared prefix of 37 tokens (four checkpoint
    positions, the last at 32) and a suffix of its own, then one prompt of its own."""
    rng = random.Random(1)
    out = []
    for _ in range(3):
        prefix = [rng.randint(3, 500) for _ in range(37)]
        out += [prefix + [rng.randint(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    return out + [[rng.randint(3, 500) for _ in range(29)]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint (EOS set to a token the greedy runs emit), its prompts and the
    tier-off run's outputs: tokens only, and with logprobs."""
    path = tmp_path_factory.mktemp("kimi-linear-prefix")
    prompts = _prompts()
    Reference(save_tiny_kimi(path, **PATTERNS["kda3_mla1"]), path, prompts)
    plain = LLM(model=str(path), **POOL)
    ref = [plain.generate(prompts, p, use_tqdm=False) for p in (TOKENS, LOGPROBS)]
    assert plain.engine.kv.prefix_hit_tokens == 0 and plain.engine.checkpoints is None
    assert any(o.outputs[0].finish_reason == "stop" for o in ref[0]), "no EOS ending"
    return str(path), prompts, ref


def _check_same(outs, ref, logprobs: bool) -> None:
    for i, (got, want) in enumerate(zip(outs, ref, strict=True)):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids, f"request {i}"
        assert g.finish_reason == w.finish_reason, f"request {i}"
        for step, tok in enumerate(w.token_ids if logprobs else ()):
            diff = abs(g.logprobs[step][tok].logprob - w.logprobs[step][tok].logprob)
            assert diff < 1e-4, f"request {i} step {step}: logprob differs by {diff:.2e}"


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_shared_prefixes_resume_from_state_checkpoints(model, debug):
    path, prompts, ref = model
    llm = LLM(model=path, batchgen_debug=debug, **TIER, **POOL)
    _check_same(llm.generate(prompts, TOKENS, use_tqdm=False), ref[0], logprobs=False)
    m = llm.engine.metrics()
    # each group's first request stores positions 8..32, the positions its group shares
    # (state_checkpoint_policy "shared"); its two others resume at 32. Positions past a
    # group's prefix and the lone prompt's are stored by nobody.
    assert m["state_checkpoints"] == 3 * 4, m
    assert m["state_checkpoint_hit_tokens"] == 3 * 2 * 32, m
    # the hit's pages are cut to its checkpoint too: nothing else of the prefix is reused
    assert m["prefix_hit_tokens"] + 4 * m["host_prefix_hit_pages"] == 3 * 2 * 32, m
    assert m["prefill_tokens_computed"] == sum(map(len, prompts)) - 3 * 2 * 32, m
    slot = llm.engine.state_pool.layout.bytes_per_slot
    assert m["bytes_state_checkpoint"] == m["state_checkpoints"] * slot, m
    assert m["bytes_state_checkpoint_load"] == 3 * 2 * slot, m
    assert (m["readback_checks"] > 0) == debug, m
    assert llm.engine.tier.num_in_flight == 0

    # a second call on the same engine: every prompt of a group now hits at 32
    _check_same(llm.generate(prompts, LOGPROBS, use_tqdm=False), ref[1], logprobs=True)
    again = llm.engine.metrics()
    hits = again["state_checkpoint_hit_tokens"] - m["state_checkpoint_hit_tokens"]
    assert hits >= 3 * 3 * 32, again


def test_policy_all_stores_every_position(model):
    """state_checkpoint_policy="all": positions nobody else shares are stored too (the
    groups' suffixes, the lone prompt), so a later call with the lone prompt hits; the
    outputs are the tier-off run's either way. Under "shared" it does not hit, and no
    finished request is still counted as a holder."""
    path, prompts, ref = model
    lone = prompts[-1:]
    for policy in ("all", "shared"):
        llm = LLM(model=path, state_checkpoint_policy=policy, **TIER, **POOL)
        _check_same(llm.generate(prompts, TOKENS, use_tqdm=False), ref[0], logprobs=False)
        m = llm.engine.metrics()
        assert m["state_checkpoint_hit_tokens"] == 3 * 2 * 32, m
        if policy == "all":
            assert m["state_checkpoints"] > 3 * 4 + 3, m  # + the lone prompt's 8, 16, 24
        else:
            assert m["state_checkpoints"] == 3 * 4, m
            assert not llm.engine.checkpoints._holders and not llm.engine.checkpoints._tracked
        _check_same(llm.generate(lone, LOGPROBS, use_tqdm=False), ref[1][-1:], logprobs=True)
        hit = llm.engine.metrics()["state_checkpoint_hit_tokens"] - m["state_checkpoint_hit_tokens"]
        assert hit == (24 if policy == "all" else 0), (policy, hit)


def test_an_unknown_checkpoint_policy_is_named(model):
    path, _, _ = model
    with pytest.raises(ValueError, match="state_checkpoint_policy must be 'shared' or 'all'"):
        LLM(model=path, state_checkpoint_policy="some", **TIER, **POOL)


def test_interval_zero_turns_prefix_hits_off(model):
    path, prompts, ref = model
    llm = LLM(model=path, **{**TIER, "state_checkpoint_interval": 0}, **POOL)
    _check_same(llm.generate(prompts, TOKENS, use_tqdm=False), ref[0], logprobs=False)
    assert llm.engine.checkpoints is None and llm.engine.kv.prefix_hit_tokens == 0


def test_interval_must_be_a_multiple_of_the_page_size(model):
    path, _, _ = model
    with pytest.raises(ValueError, match="state_checkpoint_interval must be 0 or a positive"):
        LLM(model=path, **{**TIER, "state_checkpoint_interval": 6}, **POOL)


def test_checkpoints_beside_swaps_in_a_small_pool(model):
    """40 pages for ten requests: preempted requests swap their pages and state while
    others resume from checkpoints; a swap that finds no free host slot takes one a
    checkpoint held."""
    path, prompts, ref = model
    llm = LLM(model=path, **TIER, **{**POOL, "num_kv_pages": 40, "max_model_len": 160})
    _check_same(llm.generate(prompts, LOGPROBS, use_tqdm=False), ref[1], logprobs=True)
    m = llm.engine.metrics()
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] == m["state_swaps_out"], m
    assert m["state_checkpoint_hit_tokens"] > 0 and m["recomputes"] == 0, m
    assert llm.engine.tier.num_in_flight == 0
