"""Kimi Linear under async scheduling: every step, prefill chunks included, is scheduled
and launched while the one before runs. A KDA layer's state slot is read and written by
each step in stream order, and what the host tier copies of it (swaps, checkpoints) is
submitted between two launches, so it holds the state of the tokens committed so far.

CPU fp32, tiny random checkpoint, the defaults (EOS endings, pipelined decode) plus
async_scheduling; each run compared with the same engine's plain steps: greedy tokens
and finish reasons identical (a request with logprobs makes steps synchronous, so the
runs here ask for none)."""

from __future__ import annotations

import pytest
from conftest import count_launches_ahead
from test_kimi_linear import (
    PATTERNS,
    RUN,
    _prompts,
    save_tiny_kimi,
    transformers_torch_path,  # noqa: F401 (autouse: torch KDA)
)
from test_kimi_linear_prefix import _prompts as _shared_prompts

from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOKENS = SamplingParams(temperature=0, max_tokens=20)
TIER = dict(host_kv_size_gib=0.01, tier_policy="always")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi-linear-async")
    save_tiny_kimi(out, **PATTERNS["kda3_mla1"])
    return str(out)


def _run(path, prompts, params, async_: bool, **kw):
    """The outputs, the launches made while a step was in flight (and how many of them
    held a prefill chunk) and the engine, checked idle and empty; without async_, plain
    steps (pipelined decode also launches steps that admit behind one in flight)."""
    llm = LLM(model=path, pipeline_decode=async_, async_scheduling=async_, **{**RUN, **kw})
    assert (llm.engine.overlap.name == "async") == async_
    ahead = count_launches_ahead(llm.engine.runner)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished and not engine.requests
    assert engine.state_slots.num_free == engine.state_slots.num_slots
    if engine.tier is not None:
        assert engine.tier.num_in_flight == 0
    return outs, ahead, engine


def _same(path, prompts, params, **kw):
    plain, ahead, _ = _run(path, prompts, params, False, **kw)
    assert ahead["steps"] == 0
    outs, ahead, engine = _run(path, prompts, params, True, **kw)
    assert ahead["steps"] > 0 and ahead["with_prefill"] > 0, ahead
    for i, (got, want) in enumerate(zip(outs, plain, strict=True)):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, f"request {i}"
    return outs, engine


def test_defaults_with_eos_and_stop_strings(path):
    """The first row: EOS on, a stop token and a stop string that outputs reach midway,
    prompts longer than a step's budget (chunks follow each other in flight)."""
    prompts = _prompts()
    free, _, _ = _run(path, prompts, TOKENS, False, max_num_batched_tokens=48)
    stop_token = free[0].outputs[0].token_ids[5]
    stop_text = next(o.outputs[0].text[2:6] for o in free if len(o.outputs[0].text) > 8)
    params = SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_token], stop=[stop_text]
    )
    outs, _ = _same(path, prompts, params, max_num_batched_tokens=48)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_swaps_of_pages_and_state(path):
    """A tight pool: preempted requests swap their pages and KDA state to host and back,
    decided while a step is in flight."""
    kw = dict(num_kv_pages=40, max_num_batched_tokens=48, max_model_len=160, **TIER)
    _, engine = _same(path, _prompts(), TOKENS, state_checkpoint_interval=0, **kw)
    m = engine.metrics()
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] == m["state_swaps_out"], m
    assert m["recomputes"] == 0, m


def test_prefix_hits_from_state_checkpoints(path):
    """Shared prefixes: the first request of a group stores its state at each checkpoint
    position as its chunks end there, the others resume from it."""
    kw = dict(num_kv_pages=400, max_num_batched_tokens=48, state_checkpoint_interval=8, **TIER)
    _, engine = _same(path, _shared_prompts(), TOKENS, **kw)
    m = engine.metrics()
    assert m["state_checkpoint_hit_tokens"] > 0 and m["state_checkpoints"] > 0, m


def test_checkpoints_beside_swaps_in_a_small_pool(path):
    kw = dict(num_kv_pages=40, max_num_batched_tokens=48, max_model_len=160, **TIER)
    _, engine = _same(path, _shared_prompts(), TOKENS, state_checkpoint_interval=8, **kw)
    m = engine.metrics()
    assert m["state_swaps_out"] > 0 and m["state_checkpoint_hit_tokens"] > 0, m
