"""benchmarks/schedule_replay.py: an ample-pool engine computing a tier run's recorded
rows, step by step, on the CPU."""

from __future__ import annotations

import random

import pytest
from bench_scripts import load

from batchgen import LLM, SamplingParams

sr = load("schedule_replay")


def _kw(tmp_path, model: str = "SMALL_MOONLIGHT") -> dict:
    workloads = load("workloads")
    path = workloads.config_dir(tmp_path / model, getattr(workloads, model), "float32")
    return dict(model=str(path), load_format="dummy", device="cpu", max_model_len=96, page_size=4)


def _prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randint(0, 400) for _ in range(rng.randint(24, 48))] for _ in range(n)]


def _record(kw, prompts, params, **tier):
    llm = LLM(**kw, **tier)
    recorder = sr.StepRecorder(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = [list(o.outputs[0].token_ids) for o in outs]
    steps = [[(f"p{rid.split('-')[-1]}", s, n) for rid, s, n in st] for st in recorder.steps]
    return rows, steps, llm.engine.metrics()


def _replay(kw, prompts, params, steps):
    llm = LLM(**kw, pipeline_decode=False, enable_prefix_caching=False)
    scheduler = sr.ReplayScheduler.install(llm.engine, steps)
    again = sr.StepRecorder(llm.engine)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"p{i}", prompt, sr.replay_params(params))
    while not scheduler.done:
        llm.engine.step()
    rows = [list(scheduler.by_id[f"p{i}"].output_token_ids) for i in range(len(prompts))]
    return rows, again.steps, llm.engine


def _starts(steps):
    """(the request's previous row end, this row's start) for each row after its first."""
    end = {}
    for step in steps:
        for rid, start, n in step:
            if rid in end:
                yield end[rid], start
            end[rid] = start + n


@pytest.mark.parametrize("host_gib", [0.002, 0.0], ids=["swaps", "recomputes"])
def test_replay_computes_the_recorded_rows_and_tokens(tmp_path, host_gib):
    """The tier run in defaults (pipelined decode, EOS endings) with a pool that forces
    preemption: the replay launches the very same rows in the same order, and its tokens
    are the tier run's (past an EOS, the row a pipelined step computed anyway)."""
    kw, prompts = _kw(tmp_path), _prompts()
    params = SamplingParams(temperature=0, max_tokens=16)
    tier = dict(num_kv_pages=40, host_kv_size_gib=host_gib)
    if host_gib:
        tier["tier_policy"] = "always"
    tier_rows, steps, m = _record(kw, prompts, params, **tier)
    assert m["preemptions"] > 0
    if host_gib == 0.002:
        assert m["swaps_out"] > 0
    else:  # no tier: recomputed (from a device prefix hit or 0), so the replay rewinds
        assert m["recomputes"] > 0
        assert any(s < prev for prev, s in _starts(steps))
    rows, replayed, engine = _replay(kw, prompts, params, steps)
    assert replayed == steps
    assert [r[: len(t)] for r, t in zip(rows, tier_rows)] == tier_rows
    assert engine.tier is None and not engine.requests
    assert sum(len(r) > len(t) for r, t in zip(rows, tier_rows)) <= sum(
        len(t) < 16 for t in tier_rows
    )  # only a row that stopped early can have one token more


def test_replay_of_a_hybrid_model_with_state_swaps(tmp_path):
    kw, prompts = _kw(tmp_path, "SMALL_KIMI"), _prompts(8)
    params = SamplingParams(temperature=0, max_tokens=12)
    tier = dict(num_kv_pages=40, host_kv_size_gib=0.01, tier_policy="always")
    tier_rows, steps, m = _record(kw, prompts, params, **tier)
    assert m["state_swaps_out"] > 0
    rows, replayed, _ = _replay(kw, prompts, params, steps)
    assert replayed == steps
    assert [r[: len(t)] for r, t in zip(rows, tier_rows)] == tier_rows


def test_replay_refuses_what_it_cannot_reproduce(tmp_path):
    kw = _kw(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=4)
    piped = LLM(**kw, enable_prefix_caching=False)
    with pytest.raises(sr.ReplayError, match="pipeline_decode=False"):
        sr.ReplayScheduler.install(piped.engine, [])
    cached = LLM(**kw, pipeline_decode=False)
    with pytest.raises(sr.ReplayError, match="without prefix caching"):
        sr.ReplayScheduler.install(cached.engine, [])
    plain = LLM(**kw, pipeline_decode=False, enable_prefix_caching=False)
    # a first row past position 0 (a prefix hit in the recorded run)
    scheduler = sr.ReplayScheduler.install(plain.engine, [[("a", 8, 4)]])
    plain.engine.add_request("a", list(range(1, 21)), sr.replay_params(params))
    with pytest.raises(sr.ReplayError, match="first admitted at position 8"):
        plain.engine.step()
    with pytest.raises(sr.ReplayError, match="no row in the recording"):
        scheduler.add(plain.engine.requests["a"].__class__("b", [1, 2], params, 4))


def test_replay_catches_pages_loaded_wrong(tmp_path, monkeypatch):
    """The comparison can fail: a tier run whose swap-in loads leave layer 0 of every
    loaded page zeroed diverges from its replay, where those pages never moved."""
    import batchgen.kv.copy_ledger as copy_ledger

    load = copy_ledger.host_to_device_pages

    def zeroing(host_kv, dev_kv, host_pages, dev_pages, on_layer=None, **kw):
        handle = load(host_kv, dev_kv, host_pages, dev_pages, on_layer, **kw)
        dev_kv[0].index_fill_(1, handle[1], 0.0)
        return handle

    monkeypatch.setattr(copy_ledger, "host_to_device_pages", zeroing)
    kw, prompts = _kw(tmp_path), _prompts()
    params = SamplingParams(temperature=0, max_tokens=16)
    tier = dict(num_kv_pages=40, host_kv_size_gib=0.002, tier_policy="always")
    tier_rows, steps, m = _record(kw, prompts, params, **tier)
    assert m["swaps_in"] > 0 and m["pages_loaded"] > 0
    rows, replayed, _ = _replay(kw, prompts, params, steps)
    assert replayed == steps  # the same rows, and yet
    assert [r[: len(t)] for r, t in zip(rows, tier_rows)] != tier_rows
