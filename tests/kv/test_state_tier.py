"""StateTier bookkeeping on the CPU: a stored then loaded slot equals its source; a device
slot read by a store is not reused before the store completes; a load waits for the
store writing its host slot; host slots come back; batchgen_debug readback.

On the CPU each copy stream has its own worker thread (test_tier_lifecycle.py says why
that makes a missing wait visible here)."""

from __future__ import annotations

import pytest
import torch
from tier_parts import STATE_LAYOUT, block_streams, make_state_tier

import batchgen.kv.copy_ledger as copy_ledger
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.state_pool import HostStatePool, StatePool
from batchgen.kv.tiered import KVReadbackError


def source(tier, slot):
    pool = tier.device_pool
    return pool.states[:, slot].clone(), pool.windows[:, slot].clone()


def test_a_stored_then_loaded_slot_equals_the_original():
    tier, slots = make_state_tier()
    slots.take("other")
    slot = slots.take("r")
    want = source(tier, slot)
    tier.store("r", "request r")
    tier.drain()
    tier.device_pool.states.zero_()  # whatever the device slots held since
    tier.device_pool.windows.zero_()
    slots.take("x")  # the freed slot went to someone else: the load gets another
    tier.load("r")
    tier.drain()
    back = slots.slot("r")
    assert back != slot
    assert torch.equal(tier.device_pool.states[:, back], want[0])
    assert torch.equal(tier.device_pool.windows[:, back], want[1])
    assert tier.host_room == 2 and not tier.holds("r")
    m = tier.metrics
    assert (m.state_swaps_out, m.state_swaps_in) == (1, 1)
    assert m.bytes_by_reason == {
        "state_swap_out": STATE_LAYOUT.bytes_per_slot,
        "state_swap_in": STATE_LAYOUT.bytes_per_slot,
    }


def test_a_full_host_pool_has_no_room_and_a_forgotten_slot_comes_back():
    tier, slots = make_state_tier(host_slots=1)
    slots.take("a")
    slots.take("b")
    release = block_streams(tier)
    tier.store("a", "request a")
    assert tier.host_room == 0  # the caller recomputes b instead
    tier.forget("a")  # a ends while swapped, its store still in flight
    assert tier.host_room == 0
    release.set()
    tier.drain()
    assert tier.host_room == 1 and slots.num_free == 2


def test_debug_readback_compares_the_host_slot_with_its_source(monkeypatch):
    tier, slots = make_state_tier(debug=True)
    slots.take("r")
    tier.store("r", "request r")
    assert tier.metrics.readback_checks == 1
    real = copy_ledger.device_to_host_state

    def corrupt(dev, host, dev_slots, host_slots):
        keep = real(dev, host, dev_slots, host_slots)
        host[1][2, host_slots[0]] += 1  # layer 2's conv window
        return keep

    monkeypatch.setattr(copy_ledger, "device_to_host_state", corrupt)
    slots.take("s")
    with pytest.raises(KVReadbackError, match=r"request s: KDA layer 2's conv window"):
        tier.store("s", "request s")


def test_no_readback_when_debug_is_off():
    tier, slots = make_state_tier()
    slots.take("r")
    release = block_streams(tier)
    tier.store("r", "request r")  # returns with the copy blocked: nothing waited on it
    assert tier.metrics.readback_checks == 0 and tier.num_in_flight == 1
    release.set()
    tier.drain()


def test_a_worker_mirror_replays_the_logged_state_copies_on_its_own_pools():
    """Tensor parallel: rank 0's state tier logs each copy it submits (swap-out, swap-in,
    checkpoint out and in); a worker's TierMirror replays them on its own device and
    host slots (other values: its heads), ending with the same slots moved the same way."""
    from batchgen.kv.host_pool import HostPool
    from batchgen.kv.layout import KVLayout
    from batchgen.kv.page_pool import PagePool
    from batchgen.kv.tier_mirror import TierMirror

    logged = []
    tier, slots = make_state_tier(dev_slots=4, host_slots=3, mirror=logged.append)
    worker_dev = StatePool(STATE_LAYOUT, 4, "cpu")
    worker_dev.states.normal_()
    worker_dev.windows.normal_()
    worker_host = HostStatePool(STATE_LAYOUT, 3, pin=False)
    kv = KVLayout(1, 1, 2, 4, torch.float32)
    mirror = TierMirror(
        PagePool(kv, 2, torch.device("cpu")),
        HostPool(kv, 2, pin=False),
        CopyEngine(torch.device("cpu"), num_streams=1),
        debug=True,
        states=(worker_dev, worker_host),
    )
    slot_r = slots.take("r")
    slot_c = slots.take("c")
    kept = {
        s: (worker_dev.states[:, s].clone(), worker_dev.windows[:, s].clone())
        for s in (slot_r, slot_c)
    }
    tier.store("r", "request r")  # swap-out of r
    ck = tier.take_host_slot()
    tier.checkpoint_out(slot_c, ck, "request c")  # a checkpoint of c into host slot ck
    tier.drain()  # r's device slot is free once its store completes
    slots.take("x")  # and may go to another request meanwhile
    tier.load("r")  # swap-in, into another device slot
    tier.checkpoint_in(ck, slots.take("d"))  # d resumes from c's checkpoint
    tier.drain()
    assert [c.kind for c in logged] == ["state_store", "state_store", "state_load", "state_load"]
    handles = mirror.issue(logged)
    assert len(handles) == 4
    mirror.drain()
    for copy in logged[2:]:  # each load's device slot holds what its store read, worker side
        source_slot = slot_r if copy is logged[2] else slot_c
        dest = copy.dev_pages[0]
        assert torch.equal(worker_dev.states[:, dest], kept[source_slot][0])
        assert torch.equal(worker_dev.windows[:, dest], kept[source_slot][1])
    m = mirror.metrics
    assert (m.state_stores, m.state_loads) == (2, 2)
    assert m.readback_checks == 2  # debug: each store's slot (state and window) compared


def test_a_bad_state_load_scatter_is_named():
    with pytest.raises(ValueError, match="load_scatter"):
        make_state_tier(load_scatter="side")
