"""Scheduler with compressed-state slots (models with linear-attention layers), driven
with fabricated runner outputs: slots taken at admission, released at finish, abort and
preemption; no prefix hit (the state at a hit is unknown); without the host tier a
preempted request recomputes, with it (ExactSwap) it swaps whole and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.exact_swap import ExactSwap
from batchgen.kv.host_pool import HostPool
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool, StateLayout, StatePool, StateSlots
from batchgen.kv.state_tier import StateTier
from batchgen.kv.tier_metrics import TierMetrics
from batchgen.kv.tiered import TieredKVManager
from batchgen.runner.batch import ModelRunnerOutput
from batchgen.sampling_params import SamplingParams

PS = 4


def make(num_pages=64, num_slots=2, max_num_seqs=8, admission="prefix"):
    kv = KVCacheManager(PageAllocator(num_pages, True), PS)
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


def step_until_preempted(sched, requests, slots):
    """`step` until a step preempts a request; that step's output."""
    out = step(sched, requests, slots)
    while not out.preempted_ids:
        out = step(sched, requests, slots)
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


def make_swapping(num_pages=6, num_slots=2, host_pages=16, host_slots=2):
    """A hybrid scheduler with the host tier: pages and slots hold random values."""
    allocator = PageAllocator(num_pages, False)  # hybrid models cache no prefixes
    pool = PagePool(KVLayout(2, 1, 4, PS, torch.float32), num_pages, "cpu")
    pool.kv.normal_()
    layout = StateLayout(2, 2, 4, 4, 6, 4, torch.float32)
    states = StatePool(layout, num_slots, "cpu")
    states.states.normal_()
    states.windows.normal_()
    slots = StateSlots(num_slots)
    host = HostStatePool(layout, host_slots, False)
    copies, metrics = CopyEngine(torch.device("cpu")), TierMetrics()
    tier = TieredKVManager(
        pool,
        HostPool(pool.layout, host_pages, False),
        allocator,
        copies,
        metrics=metrics,
        states=StateTier(states, host, slots, copies, metrics),
    )
    kv = KVCacheManager(allocator, PS, tier)
    swap = ExactSwap(kv, tier.states)
    sched = Scheduler(kv, 2, 64, 1000, [2], state_slots=slots, exact_swap=swap)
    return sched, slots, tier


def test_preemption_with_the_tier_swaps_pages_and_state_and_resumes_exactly():
    # 6 pages of 4 tokens: a and b grow to 4 pages each, so a's growth preempts b
    sched, slots, tier = make_swapping()
    requests = {}
    a = add(sched, requests, "a", 4, max_tokens=12)
    b = add(sched, requests, "b", 6, max_tokens=12, base=2000)
    out = step_until_preempted(sched, requests, slots)
    assert out.preempted_ids == ["b"]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens > 0
    computed = b.num_computed_tokens
    assert not slots.holds("b") and sched.num_recomputes == 0
    tier.drain()  # the page store and the state store
    states = tier.states
    host_slot = states._owned["b"]
    saved = states.host_pool.states[:, host_slot].clone()
    host_pages = sched.exact_swap._host_pages["b"]
    saved_kv = tier.host_pool.kv[:, host_pages].clone()
    assert len(host_pages) == -(-computed // PS)  # its partial last page too
    assert slots.num_free == 1  # b's device slot came back once its store completed

    other = slots.take("x")
    while not a.is_finished:
        step(sched, requests, slots)
    slots.take("y")  # a's slot: none is free, b stays swapped whatever pages are free
    out = step(sched, requests, slots)
    assert out.requests == [] and b.status == RequestStatus.SWAPPED
    slots.release("x")
    out = step(sched, requests, slots)
    (s,) = out.requests
    assert s.request_id == "b" and s.start == computed  # resumes where it stopped
    assert s.state_slot == other
    assert len(sched.take_copies().wait_for) == 2  # the page load and the state load
    tier.drain()
    assert torch.equal(states.device_pool.states[:, other], saved)
    dev_pages = sched.kv.pages["b"][: len(host_pages)]
    assert torch.equal(tier.device_pool.kv[:, :, dev_pages], saved_kv.transpose(1, 2))
    while not b.is_finished:
        step(sched, requests, slots)
    tier.drain()
    m = tier.metrics
    assert (m.swaps_out, m.swaps_in, m.state_swaps_out, m.state_swaps_in) == (1, 1, 1, 1)
    assert states.host_room == 2 and tier.host_alloc.num_free == tier.host_pool.num_pages


def test_no_host_state_slot_left_recomputes():
    sched, slots, tier = make_swapping(host_slots=1)
    tier.states._free.clear()  # the only host slot is taken
    requests = {}
    add(sched, requests, "a", 4, max_tokens=12)
    b = add(sched, requests, "b", 6, max_tokens=12, base=2000)
    step_until_preempted(sched, requests, slots)
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert sched.num_recomputes == 1 and tier.metrics.swaps_out == 0
    assert tier.host_alloc.num_free == tier.host_pool.num_pages  # no page went either
