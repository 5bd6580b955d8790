"""TieredKVManager bookkeeping on the CPU: pages in flight are never freed, evicted or
reused; host LRU order; batchgen_debug readback."""

from __future__ import annotations

import threading

import pytest
import torch

from batchgen.kv import page_copies
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.tiered import KVReadbackError, TieredKVManager

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)


def make(dev_pages=6, host_pages=4, debug=False):
    pool = PagePool(LAYOUT, dev_pages, torch.device("cpu"))
    pool.kv.normal_()
    alloc = PageAllocator(dev_pages)
    tier = TieredKVManager(
        pool,
        HostPool(LAYOUT, host_pages, pin=False),
        alloc,
        CopyEngine(torch.device("cpu")),
        debug=debug,
    )
    return tier, alloc


def gate(tier):
    """Block the copy worker until the returned event is set (copies queue behind it)."""
    ev = threading.Event()
    tier.copies.submit("gate", 0, lambda: ev.wait(10))
    return ev


def test_device_pages_read_by_a_store_are_not_freed_until_it_completes():
    tier, alloc = make()
    pages = alloc.allocate(2)
    host = tier.host_alloc.allocate(2)
    expected = tier.device_pool.kv[:, :, pages].clone()
    release = gate(tier)
    tier.prepare_store(pages, host, [None, None], [4, 4], "r")
    alloc.free(pages)  # the request lets go; the copy still holds them
    assert all(alloc.ref_count[p] == 1 for p in pages)
    grabbed = alloc.allocate(alloc.num_free)  # everything allocatable
    assert not set(grabbed) & set(pages)
    tier.poll()
    assert tier.num_in_flight == 1  # blocked: nothing completes early
    release.set()
    tier.drain()
    assert all(alloc.ref_count[p] == 0 for p in pages)
    assert torch.equal(tier.host_pool.kv[host].permute(1, 2, 0, 3, 4, 5), expected)


def test_host_pages_written_by_a_store_are_not_evicted_until_it_completes():
    tier, alloc = make(host_pages=2)
    pages = alloc.allocate(2)
    host = tier.host_alloc.allocate(2)
    release = gate(tier)
    tier.prepare_store(pages, host, [b"h0", b"h1"], [4, 4], "r")
    tier.host_alloc.free(host)  # the owner lets go while the copy is in flight
    assert tier.host_alloc.num_free == 0
    with pytest.raises(RuntimeError):
        tier.host_alloc.allocate(1)
    assert tier.lookup([b"h0"]) == []  # not findable before its write completes
    release.set()
    tier.drain()
    assert tier.lookup([b"h0", b"h1"]) == host
    assert tier.host_alloc.num_free == 2  # free but cached


def test_load_waits_for_a_store_in_flight_and_holds_host_pages():
    tier, alloc = make()
    src = alloc.allocate(1)
    host = tier.host_alloc.allocate(1)
    release = gate(tier)
    tier.prepare_store(src, host, [b"x"], [4], "r")
    dst = alloc.allocate(1)
    tier.prepare_load(host, dst, "r")
    tier.host_alloc.free(host)
    assert tier.host_alloc.ref_count[host[0]] == 2  # held by the store and the load
    release.set()
    tier.drain()
    assert torch.equal(tier.device_pool.kv[:, :, dst], tier.device_pool.kv[:, :, src])
    assert tier.host_alloc.ref_count[host[0]] == 0


def test_host_lru_evicts_the_oldest_cached_page_first():
    tier, alloc = make(host_pages=3)
    dev = alloc.allocate(3)
    for i in range(3):
        h = tier.host_alloc.allocate(1)
        tier.prepare_store([dev[i]], h, [bytes([i])], [4], "r")
        tier.drain()
        tier.host_alloc.free(h)
    assert tier.lookup([bytes([0])]) and tier.lookup([bytes([2])])
    tier.host_alloc.touch(tier.lookup([bytes([0])]))  # page 0 used again: now newest
    tier.host_alloc.free(tier.lookup([bytes([0])]))
    tier.host_alloc.allocate(1)
    assert tier.lookup([bytes([1])]) == []  # the least recently used went first
    assert tier.lookup([bytes([0])]) and tier.lookup([bytes([2])])


def test_append_fills_host_slots_and_holds_device_pages():
    tier, alloc = make()
    dev = alloc.allocate(1)
    host = tier.host_alloc.allocate(1)
    s = LAYOUT.page_size
    release = gate(tier)
    tier.append_slots(
        [dev[0] * s + 1, dev[0] * s + 2], [host[0] * s + 1, host[0] * s + 2], None, "append"
    )
    alloc.free(dev)
    assert alloc.ref_count[dev[0]] == 1
    release.set()
    tier.drain()
    got = tier.host_pool.kv[host[0], :, :, 1:3]
    assert torch.equal(got, tier.device_pool.kv[:, :, dev[0], 1:3])
    assert alloc.ref_count[dev[0]] == 0


def test_debug_readback_names_request_layer_and_page(monkeypatch):
    tier, alloc = make(debug=True)
    pages = alloc.allocate(1)
    host = tier.host_alloc.allocate(1)
    real = page_copies.device_to_host_pages

    def corrupting(dev_kv, host_kv, dev_pages, host_pages):
        kept = real(dev_kv, host_kv, dev_pages, host_pages)
        host_kv[host_pages[0], 1, 0, 0, 0, 0] += 1.0  # layer 1 differs
        return kept

    monkeypatch.setattr("batchgen.kv.tiered.device_to_host_pages", corrupting)
    tier.prepare_store(pages, host, [None], [4], "request r7")
    with pytest.raises(KVReadbackError, match=r"request r7: layer 1 of device page \d+"):
        tier.drain()


def test_debug_readback_catches_non_finite_pages():
    tier, alloc = make(debug=True)
    pages = alloc.allocate(1)
    tier.device_pool.kv[0, 1, pages[0], 2] = float("nan")
    tier.prepare_store(pages, tier.host_alloc.allocate(1), [None], [4], "request q")
    with pytest.raises(KVReadbackError, match="request q: non-finite"):
        tier.drain()


def test_no_readback_cost_when_debug_is_off():
    tier, alloc = make(debug=False)
    tier.prepare_store(alloc.allocate(1), tier.host_alloc.allocate(1), [None], [4], "r")
    tier.drain()
    assert tier.metrics.readback_checks == 0


def test_copy_errors_surface_to_the_waiter():
    engine = CopyEngine(torch.device("cpu"))
    handle = engine.submit("boom", 0, lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="boom copy failed"):
        handle.synchronize()
