"""Scheduler with compressed-state slots (models with linear-attention layers), driven
with fabricated runner outputs: slots taken at admission, released at finish, abort and
preemption; no swap and no prefix hit while states cannot move to the host."""

from __future__ import annotations

import pytest

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.state_pool import StateSlots
from batchgen.runner.batch import ModelRunnerOutput
from batchgen.sampling_params import SamplingParams

PS = 4


def make(num_pages=64, num_slots=2, max_num_seqs=8, admission="prefix"):
    kv = KVCacheManager(num_pages, PS, True)
    slots = StateSlots(num_slots)
    sched = Scheduler(kv, max_num_seqs, 64, 1000, [2], admission=admission, state_slots=slots)
    return sched, slots


def add(sched, requests, rid, n, max_tokens=3, base=1000):
    req = Request(
        rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens), max_tokens
    )
    requests[rid] = req
    sched.add(req)
    return req


def step(sched, requests, slots):
    out = sched.schedule()
    seen = set()
    for s in out.requests:
        assert s.state_slot == slots.slot(s.request_id)
        assert s.state_slot not in seen
        seen.add(s.state_slot)
    sampled = [s for s in out.requests if s.sample]
    result = ModelRunnerOutput(
        [s.request_id for s in sampled], [100] * len(sampled), [None] * len(sampled)
    )
    sched.update(out, result, requests)
    return out


@pytest.mark.parametrize("admission", ["prefix", "arrival"])
def test_admission_waits_for_a_free_slot(admission):
    sched, slots = make(num_slots=2, admission=admission)
    requests = {}
    for i in range(3):
        add(sched, requests, f"r{i}", 5, base=1000 * (i + 1))
    out = step(sched, requests, slots)
    assert [s.request_id for s in out.requests] == ["r0", "r1"]
    assert slots.num_free == 0 and sched.admission_candidate() is None
    while not requests["r0"].is_finished:
        step(sched, requests, slots)
    assert not slots.holds("r0") and not slots.holds("r1")  # both finished together
    out = step(sched, requests, slots)
    assert [s.request_id for s in out.requests] == ["r2"]
    assert slots.holds("r2")


def test_abort_releases_the_slot():
    sched, slots = make()
    requests = {}
    add(sched, requests, "a", 5)
    step(sched, requests, slots)
    sched.abort(requests["a"])
    assert slots.num_free == 2


def test_preemption_recomputes_and_releases_the_slot():
    # 4 pages of 4 tokens: a and b each fill two, then a's growth preempts b
    sched, slots = make(num_pages=4, num_slots=2, max_num_seqs=2)
    requests = {}
    a = add(sched, requests, "a", 4, max_tokens=20)
    b = add(sched, requests, "b", 4, max_tokens=20, base=2000)
    out = None
    for _ in range(6):
        out = step(sched, requests, slots)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert not slots.holds("b") and slots.holds("a")
    assert a.status == RequestStatus.RUNNING


def test_prefix_hits_are_not_used():
    sched, slots = make()
    requests = {}
    add(sched, requests, "a", 9, max_tokens=1)
    while not requests["a"].is_finished:
        step(sched, requests, slots)
    add(sched, requests, "b", 9, max_tokens=1)  # same prompt: its pages are cached
    out = step(sched, requests, slots)
    (s,) = out.requests
    assert s.request_id == "b" and s.start == 0  # the state at the hit is unknown
