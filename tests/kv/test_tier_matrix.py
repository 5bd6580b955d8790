"""The host tier in the configurations users run, on the CPU: tier on x pipelined decode
on/off x decode_append off/batched/layer, debug off, admission and tier_policy at their
defaults, one mixed batch whose requests end by EOS, stop token id, stop string and
length (tier_workload.py); plus aborts and reconfigure() driven by hand. Every output
(token ids, finish_reason, stop_reason, text) must equal the tier-off run's, and each
case must really swap, really hit host prefixes and, pipelined, really queue steps and
really end requests while a step is queued. The first row is the default configuration.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import record_queued
from tier_workload import (
    KINDS,
    assert_nothing_held,
    assert_stores_ahead_follow_a_launch,
    build,
    endings,
    request_row,
    rows,
    spy_finishes,
    spy_stores_ahead,
)

from batchgen import LLM
from batchgen.engine.request import RequestStatus

BASE = dict(device="cpu", page_size=4, max_model_len=160, max_num_batched_tokens=48)
TIER = dict(num_kv_pages=40, host_kv_size_gib=0.02)  # 40 pages: 160 tokens, preempts often
ROWS = [
    pytest.param(True, "off", "copy", id="default-pipelined-append-off"),
    pytest.param(True, "batched", "copy", id="pipelined-append-batched"),
    pytest.param(True, "layer", "copy", id="pipelined-append-layer"),
    pytest.param(False, "off", "copy", id="plain-append-off"),
    pytest.param(False, "batched", "copy", id="plain-append-batched"),
    pytest.param(False, "layer", "copy", id="plain-append-layer"),
    # tier_load_scatter="compute": each load's scatter deferred to the compute stream
    pytest.param(True, "off", "compute", id="pipelined-append-off-scatter-compute"),
    pytest.param(False, "layer", "compute", id="plain-append-layer-scatter-compute"),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the fastest for these tiny matrices, and steady on a busy
    machine (idle OpenMP workers spin when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The model, prompts, params and the tier-off reference rows (ample pool)."""
    path, prompts, params = build(tmp_path_factory, num_kv_pages=600, **BASE)
    ref = LLM(model=path, num_kv_pages=600, **BASE)
    reference = rows(ref.generate(prompts, params, use_tqdm=False))
    counts = endings(reference)
    assert all(counts[k] >= 2 for k in KINDS), f"the workload lost an ending kind: {counts}"
    assert ref.engine.metrics()["preemptions"] == 0
    return path, prompts, params, reference


def _diff(got, want) -> str:
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return f"rows {bad} differ; first: {[(got[i], want[i]) for i in bad[:2]]}"


def _queues(pipeline: bool, decode_append: str) -> bool:
    """Whether the row queues pipelined steps: the hand-driven tests wait for one then."""
    return pipeline


def spy_recomputes(engine) -> list[int]:
    """The tokens each preemption that recomputes (not swaps) had computed. A request with
    less than a page computed has nothing the tier keeps, so it recomputes by design;
    whether reconfigure() finds one so young depends on when the CPU copy threads finish
    (the schedule waits on them), so tests bound what was lost, not the count."""
    lost: list[int] = []
    preempt = engine.scheduler.preempt

    def spied(request):
        computed = request.num_computed_tokens
        preempt(request)
        if request.status != RequestStatus.SWAPPED:
            lost.append(computed)

    engine.scheduler.preempt = spied
    return lost


def _tier_llm(path, pipeline, decode_append, scatter="copy", **kw):
    return LLM(
        model=path,
        pipeline_decode=pipeline,
        decode_append=decode_append,
        tier_load_scatter=scatter,
        **TIER,
        **BASE,
        **kw,
    )


def spy_deferred(monkeypatch) -> list:
    """Every load handle that deferred its scatter (tier_load_scatter="compute")."""
    from batchgen.kv.copy_engine import CopyHandle

    handles = []
    defer = CopyHandle.defer

    def spied(self, gate, finish):
        if not handles or handles[-1] is not self:
            handles.append(self)
        defer(self, gate, finish)

    monkeypatch.setattr(CopyHandle, "defer", spied)
    return handles


@pytest.mark.parametrize("pipeline,decode_append,scatter", ROWS)
def test_mixed_endings_match_tier_off(workload, pipeline, decode_append, scatter, monkeypatch):
    path, prompts, params, reference = workload
    llm = _tier_llm(path, pipeline, decode_append, scatter)
    deferred = spy_deferred(monkeypatch)
    launches = record_queued(llm.engine.runner)
    finishes = spy_finishes(llm.engine)
    lost = spy_recomputes(llm.engine)
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert got == reference, _diff(got, reference)
    m = llm.engine.metrics()
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0, m
    # every preempted request with a page computed swapped; one with less has nothing the
    # tier keeps (whether the preemption finds one so young depends on the copy threads)
    assert m["recomputes"] == len(lost) and all(n < BASE["page_size"] for n in lost), (lost, m)
    assert_nothing_held(llm.engine)
    # the same batch again: the pool has turned over many times, so the prompts' pages
    # are gone from the device and come back from host (whatever the admission order)
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert got == reference, _diff(got, reference)
    again = llm.engine.metrics()
    assert again["host_prefix_hit_pages"] > m["host_prefix_hit_pages"], again
    assert again["bytes_prefix_load"] > 0, again
    assert_nothing_held(llm.engine)
    # every load deferred its scatter or none did, and each deferred part ran
    assert bool(deferred) == (scatter == "compute"), len(deferred)
    assert not [h for h in deferred if h.has_deferred]
    if not pipeline:
        assert not launches, "pipeline_decode=False launched a pipelined decode step"
        return
    # decode_append="layer" hooks only the steps whose decode tokens fill a page: the
    # others must still be queued pipelined
    assert sum(launches) > 0, f"decode_append={decode_append!r}: no decode step was queued"
    for k in ("eos", "stop_token", "stop_string"):
        assert finishes[k] > 0, f"no request ended by {k} while a step was queued"


def _start(engine, prompts, params, tag):
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    return ids, {rid: engine.requests[rid] for rid in ids}


def _queued_ids(engine) -> list[str]:
    """Live requests of the queued pipelined step, if one is queued."""
    if engine._in_flight is None:
        return []
    return [
        r.request_id for r in engine._in_flight.sched.requests if r.request_id in engine.requests
    ]


def _victim(engine, done: dict) -> tuple[str, str] | None:
    """A request to abort in a state not aborted from yet: queued in a pipelined step,
    swapped to host, running (no step queued), waiting (never admitted)."""
    sched = engine.scheduler
    candidates = {
        "queued": _queued_ids(engine),
        "swapped": [r.request_id for r in sched.waiting if r.status == RequestStatus.SWAPPED],
        "running": [] if engine._in_flight else [r.request_id for r in sched.running],
        "waiting": [
            r.request_id
            for r in sched.waiting
            if r.status == RequestStatus.WAITING and not r.num_preemptions
        ],
    }
    for state, rids in candidates.items():
        if state not in done and rids:
            return state, rids[-1]
    return None


@pytest.mark.parametrize("pipeline,decode_append,scatter", ROWS)
def test_aborts_in_every_state_leave_others_exact_and_nothing_held(
    workload, pipeline, decode_append, scatter
):
    path, prompts, params, reference = workload
    llm = _tier_llm(path, pipeline, decode_append, scatter)
    engine = llm.engine
    queues = _queues(pipeline, decode_append)
    ids, reqs = _start(engine, prompts, params, "a")
    aborted: dict[str, str] = {}
    returned: Counter = Counter()
    while engine.has_unfinished:
        returned.update(r.request_id for r in engine.step())
        pick = _victim(engine, aborted)
        if pick is not None:
            aborted[pick[0]] = pick[1]
            engine.abort([pick[1]])
    states = {"swapped", "running", "waiting"} | ({"queued"} if queues else set())
    assert states <= set(aborted), f"never aborted from {states - set(aborted)}"
    gone = set(aborted.values())
    assert all(reqs[rid].finish_reason == "abort" for rid in gone)
    survivors = [i for i, rid in enumerate(ids) if rid not in gone]
    assert returned == Counter(ids[i] for i in survivors), "each survivor returned once"
    got = [request_row(reqs[ids[i]]) for i in survivors]
    assert got == [reference[i] for i in survivors], _diff(got, [reference[i] for i in survivors])
    assert engine.metrics()["swaps_out"] > 0
    assert_nothing_held(engine)
    # abort everything at once, mid-run, with a step queued when pipelined
    ids, _ = _start(engine, prompts, params, "b")
    while engine.has_unfinished and not (
        any(r.status == RequestStatus.SWAPPED for r in engine.scheduler.waiting)
        and (engine._in_flight is not None or not queues)
    ):
        engine.step()
    assert engine.has_unfinished, "the batch ended before a swap (and a queued step)"
    engine.abort(ids)
    assert not engine.has_unfinished and engine._in_flight is None
    assert_nothing_held(engine)
    # the engine is still exact afterwards, host pages written by aborted requests included
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert got == reference, _diff(got, reference)
    assert_nothing_held(engine)


def _ends_in_queued_step(engine, reference, index) -> bool:
    """A queued step holds a request whose token from it is its last (per the reference):
    reconfigure() then drains the step and step() must still return that request."""
    return any(
        len(engine.requests[rid].output_token_ids) + 1 == len(reference[index[rid]][0])
        for rid in _queued_ids(engine)
    )


@pytest.mark.parametrize("pipeline,decode_append,scatter", ROWS)
def test_reconfigure_mid_run_and_between_calls(workload, pipeline, decode_append, scatter):
    path, prompts, params, reference = workload
    llm = _tier_llm(path, pipeline, decode_append, scatter)
    engine = llm.engine
    lost = spy_recomputes(engine)
    queues = _queues(pipeline, decode_append)
    ids, reqs = _start(engine, prompts, params, "r")
    index = {rid: i for i, rid in enumerate(ids)}
    returned: Counter = Counter()
    points = [  # (pool size, when): with swapped requests alive, then with a step queued
        (56, lambda: any(r.status == RequestStatus.SWAPPED for r in engine.scheduler.waiting)),
        (40, lambda: not queues or _ends_in_queued_step(engine, reference, index)),
        (48, lambda: not queues or engine._in_flight is not None),
    ]
    hits_at = None
    while engine.has_unfinished:
        returned.update(r.request_id for r in engine.step())
        if points and engine.has_unfinished and points[0][1]():
            drains = engine._in_flight is not None
            engine.reconfigure(points.pop(0)[0])
            # the swapped requests' pages (and shared ones) went to host before the old
            # pool was dropped: host prefixes exist to survive
            assert engine.metrics()["pages_offloaded"] > 0
            if drains and len(points) == 1:
                assert engine._finished_early, "the drained step ended no request"
            if hits_at is None:
                hits_at = engine.metrics()["host_prefix_hit_pages"]
    assert not points, f"{len(points)} reconfigure() points never reached"
    assert returned == Counter(ids), "every request returned by step() exactly once"
    got = [request_row(reqs[rid]) for rid in ids]
    assert got == reference, _diff(got, reference)
    m = engine.metrics()
    assert m["swaps_in"] > 0, m
    # every preemption with a page computed swapped; only requests with less recomputed
    assert m["recomputes"] == len(lost) and all(n < BASE["page_size"] for n in lost), (lost, m)
    assert m["host_prefix_hit_pages"] > hits_at, "no host prefix hit after reconfigure()"
    assert engine.pool.num_pages == 48
    assert_nothing_held(engine)
    # between generate() calls: the device prefix cache starts empty, so every hit is
    # a host one
    engine.reconfigure(64)
    before = engine.metrics()["host_prefix_hit_pages"]
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert got == reference, _diff(got, reference)
    assert engine.metrics()["host_prefix_hit_pages"] > before
    assert engine.pool.num_pages == 64
    assert_nothing_held(engine)


def test_the_default_engine_submits_stores_ahead_after_the_forward_launch(workload):
    # the first row, on the mixed-endings batch: a swap-out step's stores ahead are
    # issued once its forward is queued (the issuing cost a W2-8B swap-out step about
    # 1.4 ms of idle GPU), never inside schedule(); the outputs stay the tier-off run's
    path, prompts, params, reference = workload
    llm = _tier_llm(path, *ROWS[0].values)
    eng = llm.engine
    assert eng.scheduler.defer_stores_ahead
    events = spy_stores_ahead(eng)
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert got == reference, _diff(got, reference)
    assert eng.metrics()["swaps_out"] > 0
    assert_stores_ahead_follow_a_launch(events)
