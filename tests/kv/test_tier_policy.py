"""What the host tier keeps and when it loads: pages reach the host only when evicted
while a queued or preempted request wants them; the cost rule leaves the tier idle when
recomputing is cheaper."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.engine import builder_plan

BASE = dict(device="cpu", page_size=4, max_model_len=96, max_num_batched_tokens=48)
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tier-policy")
    save_tiny_model(path, "Qwen2ForCausalLM")
    return str(path)


def _rows(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _random(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randint(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_a_prefix_queued_requests_want_outlives_its_running_ones_on_the_host(model_dir):
    rng = random.Random(4)
    header = [rng.randint(3, 500) for _ in range(40)]
    # arrival order, two seats: the fillers evict the header's pages while the last
    # request, queued behind them, still wants them
    prompts = [header + [7, 8, 9]] + _random(8, 40, 60, seed=5) + [header + [12, 13, 14]]
    # every prompt queued from the start: the host tier sees the last one wanting the header
    kw = dict(BASE, num_kv_pages=30, max_num_seqs=2, admission="arrival", max_queued_requests=16)
    rows, metrics = [], []
    for host in (0.01, 0.0):
        llm = LLM(model=model_dir, host_kv_size_gib=host, **kw)
        rows.append(_rows(llm.generate(prompts, GREEDY, use_tqdm=False)))
        metrics.append(llm.engine.metrics())
    on, off = metrics
    assert rows[0] == rows[1]
    hits = on["host_prefix_hit_pages"]
    assert hits >= 5 and on["bytes_write_back"] > 0  # most of the header's 10 full pages
    assert on["computed_tokens"] <= off["computed_tokens"] - hits * 4


def test_a_prefix_nobody_wants_any_more_is_not_copied(model_dir):
    rng = random.Random(4)
    header = [rng.randint(3, 500) for _ in range(40)]
    calls = [[header + [7, 8, 9]], [header + [10, 11]], _random(8, 40, 60, seed=5)]
    llm = LLM(model=model_dir, num_kv_pages=30, max_num_seqs=2, host_kv_size_gib=0.01, **BASE)
    for batch in calls:  # the last call evicts the header: no request wants it then
        llm.generate(batch, GREEDY, use_tqdm=False)
    m = llm.engine.metrics()
    assert m["prefix_hit_tokens"] >= 10 * 4  # the second call hit the header on the device
    assert m.get("bytes_write_back", 0) == 0 and m.get("bytes_offloaded", 0) == 0


def test_pages_no_one_wants_are_never_copied(model_dir):
    prompts = _random(12, 20, 40, seed=6)  # no shared pages; an ample pool: no preemption
    llm = LLM(model=model_dir, num_kv_pages=120, host_kv_size_gib=0.01, **BASE)
    for _ in range(3):  # later calls evict the earlier calls' finished pages
        llm.generate(prompts, GREEDY, use_tqdm=False)
        prompts = _random(12, 20, 40, seed=len(prompts) + _)
    m = llm.engine.metrics()
    assert m["preemptions"] == 0 and m["bytes_offloaded"] == 0 and m["bytes_loaded"] == 0


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_cost_rule_idles_the_tier_when_recompute_is_cheaper(model_dir, monkeypatch, policy):
    monkeypatch.setattr(builder_plan, "recompute_seconds_per_token", lambda *a: 1e-12)
    prompts = _random(10, 20, 30, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(BASE, num_kv_pages=40, host_kv_size_gib=0.02, tier_policy=policy)
    llm = LLM(model=model_dir, **kw)
    rows = _rows(llm.generate(prompts, params, use_tqdm=False))
    m = llm.engine.metrics()
    ref = LLM(model=model_dir, num_kv_pages=400, **BASE)
    assert rows == _rows(ref.generate(prompts, params, use_tqdm=False))
    assert m["preemptions"] > 0
    assert m["tier_loads_pay"] is (policy == "always")
    if policy == "auto":
        assert m["swaps_out"] == 0 and m["recomputes"] == m["preemptions"]
        assert m["bytes_offloaded"] == m["bytes_loaded"] == 0
    else:
        assert m["swaps_out"] > 0 and m["bytes_loaded"] > 0


def test_with_nothing_shared_only_swapped_requests_pages_move(model_dir):
    prompts = _random(10, 20, 30, seed=3)  # nothing shared; a small pool: swaps
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(model=model_dir, num_kv_pages=40, host_kv_size_gib=0.02, **BASE)
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(_random(10, 20, 30, seed=9), params, use_tqdm=False)  # evicts the first
    m = llm.engine.metrics()
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0 and m["bytes_swap_out"] > 0
    assert m.get("bytes_write_back", 0) == 0  # only swapped requests' own pages moved
