"""Kimi Linear with the host tier on: a preempted hybrid request swaps its KV pages and
its compressed state (every KDA layer's recurrent state and conv window) to host and
resumes at its exact position. CPU fp32, tiny random checkpoint, the engine's default
configuration (pipelined decode, EOS endings) unless a test says otherwise.

Each run is compared with an independent run of the same prompts on an ample device
pool with the tier off (no preemption at all): greedy tokens identical, logprobs within
1e-5.
"""

from __future__ import annotations

import pytest
from conftest import record_queued
from test_deepseek_v3 import Reference
from test_kimi_linear import (
    PATTERNS,
    RUN,
    _prompts,
    save_tiny_kimi,
    transformers_torch_path,  # noqa: F401 (autouse: torch KDA)
)

import batchgen.engine.builder_plan as builder_plan
from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOKENS = SamplingParams(temperature=0, max_tokens=24)  # pipelinable: no logprobs
LOGPROBS = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
NO_EOS = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
TIGHT = {**RUN, "max_model_len": 160}  # 40 pages of 4: the longest request fits alone
TIER = dict(host_kv_size_gib=0.01, tier_policy="always")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint whose EOS is a token the greedy runs emit (Reference sets it), its
    prompts, and the ample-pool, tier-off run's outputs (tokens only, with logprobs,
    without EOS endings)."""
    path = tmp_path_factory.mktemp("kimi-linear-swap")
    prompts = _prompts()
    Reference(save_tiny_kimi(path, **PATTERNS["kda3_mla1"]), path, prompts)
    llm = LLM(model=str(path), num_kv_pages=400, max_num_batched_tokens=48, **TIGHT)
    ample = [llm.generate(prompts, p, use_tqdm=False) for p in (TOKENS, LOGPROBS, NO_EOS)]
    assert llm.engine.scheduler.num_preemptions == 0
    assert any(o.outputs[0].finish_reason == "stop" for o in ample[0]), "no EOS ending"
    return str(path), prompts, ample


def _check_same(outs, ample, logprobs: bool) -> None:
    for got, want in zip(outs, ample, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        for step, tok in enumerate(w.token_ids if logprobs else ()):
            diff = abs(g.logprobs[step][tok].logprob - w.logprobs[step][tok].logprob)
            assert diff < 1e-5, f"step {step}: logprob differs by {diff:.2e}"


def _tight_llm(path, **kwargs) -> LLM:
    return LLM(model=path, num_kv_pages=40, max_num_batched_tokens=48, **TIER, **TIGHT, **kwargs)


def _check_swaps(llm: LLM) -> dict:
    m = llm.engine.metrics()
    assert m["preemptions"] > 0 and m["recomputes"] == 0, m
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] == m["state_swaps_out"], m
    assert m["swaps_out"] == m["state_swaps_out"] == m["preemptions"], m
    slot = llm.engine.state_pool.layout.bytes_per_slot
    assert m["bytes_state_swap_out"] == m["state_swaps_out"] * slot, m
    assert m["bytes_state_swap_in"] == m["state_swaps_in"] * slot, m
    assert m["bytes_swap_out"] > 0 and m["bytes_swap_in"] == m["bytes_swap_out"], m
    return m


def _check_released(llm: LLM) -> None:
    """Nothing in flight, every device slot, host slot and host page free again."""
    engine = llm.engine
    assert engine.tier.num_in_flight == 0
    assert engine.state_slots.num_free == engine.state_slots.num_slots
    assert engine.tier.states.host_room == engine.tier.states.host_pool.num_slots
    assert engine.tier.host_alloc.num_free == engine.tier.host_pool.num_pages


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_swapped_requests_resume_their_state_exactly(checkpoint, debug):
    path, prompts, ample = checkpoint
    llm = _tight_llm(path, batchgen_debug=debug)
    queued = record_queued(llm.engine.runner)
    _check_same(llm.generate(prompts, TOKENS, use_tqdm=False), ample[0], logprobs=False)
    m = _check_swaps(llm)
    assert (m["readback_checks"] > 0) == debug, m
    if not debug:  # debug runs no step ahead
        assert any(queued), "no decode step was queued ahead"
    assert llm.engine.kv.prefix_hit_tokens == 0  # prefix caching stays off for hybrids
    _check_released(llm)

    fresh = _tight_llm(path, batchgen_debug=debug)
    _check_same(fresh.generate(prompts, LOGPROBS, use_tqdm=False), ample[1], logprobs=True)
    _check_swaps(fresh)
    _check_released(fresh)


def test_swaps_with_the_load_scatter_on_the_compute_stream(checkpoint, monkeypatch):
    """tier_load_scatter="compute": every load, pages and state slots alike, defers its
    scatter and runs it, and the swapped requests resume exactly (default endings)."""
    from batchgen.kv.copy_engine import CopyHandle

    deferred = []
    defer = CopyHandle.defer

    def spied(self, gate, finish):
        deferred.append(self)
        defer(self, gate, finish)

    monkeypatch.setattr(CopyHandle, "defer", spied)
    path, prompts, ample = checkpoint
    llm = _tight_llm(path, tier_load_scatter="compute")
    _check_same(llm.generate(prompts, TOKENS, use_tqdm=False), ample[0], logprobs=False)
    m = _check_swaps(llm)
    # each swap-in deferred its state slot's scatter, and the steps' page loads theirs
    handles = list({id(h): h for h in deferred}.values())
    slot = llm.engine.state_pool.layout.bytes_per_slot
    state_loads = [h for h in handles if h.kind == "load" and h.nbytes == slot]
    assert len(state_loads) == m["state_swaps_in"], (len(state_loads), m)
    assert len(handles) > len(state_loads), "no page load deferred its scatter"
    assert not [h for h in deferred if h.has_deferred]
    _check_released(llm)


def test_few_seats_swap_and_resume_when_a_slot_is_free(checkpoint):
    """max_num_seqs 3, so three device and three host state slots: a swapped request
    resumes only once a device slot is free (a store's slot is not free until its copy
    completes); test_scheduler_state_slots.py shows one staying swapped without."""
    path, prompts, ample = checkpoint
    llm = LLM(
        model=path,
        num_kv_pages=40,
        max_num_batched_tokens=48,
        **TIER,
        **{**TIGHT, "max_num_seqs": 3},
        state_checkpoint_interval=0,  # no checkpoint slots: exactly one host slot a seat
    )
    assert llm.engine.tier.states.host_pool.num_slots == 3  # max_num_seqs host slots
    _check_same(llm.generate(prompts, TOKENS, use_tqdm=False), ample[0], logprobs=False)
    _check_swaps(llm)
    _check_released(llm)


def test_a_full_host_state_pool_falls_back_to_recompute(checkpoint, monkeypatch):
    """One host state slot for many preemptions (the batch twice over, no EOS endings):
    a request preempted while another's state is on host is recomputed from token 0,
    and outputs stay the same (a prompt's copies give its ample-pool output)."""
    path, prompts, ample = checkpoint
    monkeypatch.setattr(
        builder_plan, "split_host_budget", lambda config, layout: (config.host_kv_size_gib, 1)
    )
    llm = _tight_llm(path)
    assert llm.engine.tier.states.host_pool.num_slots == 1
    outs = llm.generate(prompts * 2, NO_EOS, use_tqdm=False)
    _check_same(outs, ample[2] * 2, logprobs=True)
    _check_released(llm)
    m = llm.engine.metrics()
    assert m["state_swaps_out"] > 0 and m["recomputes"] > 0, m
    assert m["preemptions"] == m["state_swaps_out"] + m["recomputes"], m


def test_reconfigure_with_a_decode_step_queued_swaps_every_running_request(checkpoint):
    """reconfigure() while a pipelined decode step is queued: the step is finished
    first, then every running request swaps its pages and state; all resume exactly in
    the new pool."""
    path, prompts, ample = checkpoint
    eng = _tight_llm(path).engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, TOKENS)
    done = {}
    while eng._in_flight is None:  # until a decode step is queued ahead
        done.update((r.request_id, r) for r in eng.step())
    running = len(eng.scheduler.running)
    before = eng.metrics()["state_swaps_out"]
    eng.reconfigure(48)
    assert eng.metrics()["state_swaps_out"] == before + running and running > 0
    while eng.has_unfinished:
        done.update((r.request_id, r) for r in eng.step())
    for i, want in enumerate(ample[0]):
        got = done[str(i)]
        assert got.output_token_ids == want.outputs[0].token_ids
        assert got.finish_reason == want.outputs[0].finish_reason
    assert eng.metrics()["recomputes"] == 0
