"""A swapped request's full pages go to host at its swap-out, their transfer on the
background copy stream, so their later eviction copies nothing on a step's critical path.
The pages are free once swapped: flush() reads them (into staging) on the compute stream,
so a new owner, or a load into them, may write them as soon as the flush returns, while
the transfer has yet to run; no step waits on the store.

On the CPU every copy stream has its own worker thread (the background one too), and
compute is synchronous: a store that read its pages on its copy stream, not in flush(),
shows up as a page written before the store read it."""

from __future__ import annotations

import threading

import torch

from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.tiered import TieredKVManager

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)
PS = LAYOUT.page_size
PAUSE = 0.3  # seconds a copy that must wait is given to (wrongly) run
TOKENS = list(range(100, 110))  # two full pages and a partial one


def make(dev_pages: int = 4, host_pages: int = 8) -> KVCacheManager:
    allocator = PageAllocator(dev_pages, True)
    pool = PagePool(LAYOUT, dev_pages, torch.device("cpu"))
    pool.kv.normal_()
    host = HostPool(LAYOUT, host_pages, pin=False)
    host.kv.fill_(-1.0)  # a page nothing wrote reads -1
    copies = CopyEngine(torch.device("cpu"), background=True)
    return KVCacheManager(allocator, PS, TieredKVManager(pool, host, allocator, copies))


def running(kv: KVCacheManager, rid: str = "a") -> tuple[list[int], list[torch.Tensor]]:
    """Admit and compute request `rid` on TOKENS; its pages and their contents."""
    kv.want(rid, TOKENS)
    assert kv.allocate(rid, len(TOKENS))
    kv.cache_computed(rid, TOKENS, len(TOKENS))
    pages = list(kv.pages[rid])
    return pages, [kv.tier.device_pool.kv[:, :, p].clone() for p in pages]


def on_host(kv: KVCacheManager, rid: str = "a") -> list[torch.Tensor]:
    hashes = kv.page_hashes(rid, TOKENS)[: len(TOKENS) // PS]
    host = kv.tier.lookup(hashes)
    assert len(host) == len(hashes), "not every full page reached the host"
    return [kv.tier.host_pool.page(h) for h in host]


def block_background(kv: KVCacheManager) -> threading.Event:
    """Hold the background stream until the returned event is set."""
    ev = threading.Event()
    kv.tier.copies.submit("gate", 0, lambda h: ev.wait(10), background=True)
    return ev


def block_all_streams(kv: KVCacheManager) -> threading.Event:
    """Hold every copy stream, the background one too, until the returned event is set."""
    ev = block_background(kv)
    for _ in range(kv.tier.copies._lanes):
        kv.tier.copies.submit("gate", 0, lambda h: ev.wait(10))
    return ev


def test_swap_out_stores_full_pages_ahead_and_their_eviction_copies_nothing():
    kv = make()
    pages, old = running(kv)
    assert kv.swap_out("a", len(TOKENS))
    assert kv.take_step_copies() == []  # the store ahead is not waited on
    kv.tier.drain()
    assert [torch.equal(h, o) for h, o in zip(on_host(kv), old[:2])] == [True, True]
    # another request takes every page, the swapped one's included: nothing to copy
    assert kv.allocate("b", kv.num_free_pages * PS)
    assert set(pages) <= set(kv.pages["b"])
    assert kv.take_step_copies() == []
    m = kv.tier.metrics
    assert m.swaps_out == 1 and m.pages_offloaded == 2  # the partial page stays behind


def test_a_page_reallocated_before_the_flush_is_read_by_the_flush_and_nothing_waits():
    kv = make()
    pages, old = running(kv)
    release = block_all_streams(kv)
    assert kv.swap_out("a", len(TOKENS))
    assert kv.allocate("b", kv.num_free_pages * PS)  # in the same schedule()
    assert set(pages[:2]) <= set(kv.pages["b"])
    assert kv.take_step_copies() == []  # a write-back now, read by the flush itself
    for p in kv.pages["b"]:
        kv.tier.device_pool.kv[:, :, p].fill_(3.0)  # the step's forward writes at once
    assert kv.tier.num_in_flight  # while no transfer has run
    release.set()
    kv.tier.drain()
    assert [torch.equal(h, o) for h, o in zip(on_host(kv), old[:2])] == [True, True]
    assert kv.tier.metrics.pages_offloaded == 2


def test_a_page_reallocated_while_its_store_ahead_is_in_flight_needs_no_wait():
    kv = make()
    pages, old = running(kv)
    release = block_background(kv)
    assert kv.swap_out("a", len(TOKENS))
    assert kv.take_step_copies() == []  # its transfer queued behind the blocked stream
    assert kv.allocate("b", kv.num_free_pages * PS)  # a later step evicts them
    assert set(pages[:2]) <= set(kv.pages["b"])
    assert kv.take_step_copies() == []  # read at the swap-out's flush: nothing to wait on
    for p in kv.pages["b"]:
        kv.tier.device_pool.kv[:, :, p].fill_(3.0)
    assert kv.tier.num_in_flight  # the transfer has not run yet
    release.set()
    kv.tier.drain()
    assert [torch.equal(h, o) for h, o in zip(on_host(kv), old[:2])] == [True, True]


def test_a_load_into_a_page_its_store_ahead_has_not_sent_runs_without_waiting_for_it():
    kv = make()
    tier = kv.tier
    page = kv.allocator.allocate(1)
    old = tier.device_pool.kv[:, :, page[0]].clone()
    release = block_background(kv)
    tier.queue_store_ahead(page, [b"ahead"], "request a")
    assert tier.flush() == []
    kv.allocator.free(page)  # reallocated, by a later step, to a host prefix hit
    host = tier.host_alloc.allocate(1)
    tier.host_pool.kv[:, host[0]].fill_(5.0)
    tier.queue_load(host, page, "prefix_load", "request c")
    (load,) = tier.flush()
    load.wait_gates()  # done while the store's transfer is still held back
    assert bool((tier.device_pool.kv[:, :, page[0]] == 5.0).all())
    assert tier.num_in_flight == 2
    release.set()
    tier.drain()
    (stored,) = tier.lookup([b"ahead"])
    assert torch.equal(tier.host_pool.page(stored), old)


def test_the_swapped_request_resumes_from_its_device_pages_with_its_store_ahead_in_flight():
    kv = make()
    pages, _ = running(kv)
    release = block_background(kv)
    assert kv.swap_out("a", len(TOKENS))
    kv.take_step_copies()
    hit = kv.lookup_prefix("a", TOKENS)
    assert list(hit) == pages[:2] and not hit.host_pages  # still cached on the device
    assert kv.allocate("a", len(TOKENS), hit)
    assert kv.take_step_copies() == []  # read-only hits: nothing to wait on
    release.set()
    kv.tier.drain()
    assert len(on_host(kv)) == 2


def test_no_store_ahead_without_host_room_and_the_swap_is_refused():
    kv = make(host_pages=1)
    running(kv)
    assert not kv.swap_out("a", len(TOKENS))  # two pages, room for one
    assert kv.tier.num_in_flight == 0 and kv.take_step_copies() == []


def test_background_copies_never_queue_ahead_of_the_others():
    copies = CopyEngine(torch.device("cpu"), background=True)
    release = threading.Event()
    copies.submit("slow", 0, lambda h: release.wait(10), background=True)
    urgent = [copies.submit("urgent", 0, lambda h: None) for _ in range(2)]  # each stream
    assert all(h.completed.wait(10 * PAUSE) for h in urgent)  # none behind the slow one
    release.set()
    copies.close()


def test_without_a_background_stream_background_copies_share_the_streams_in_turn():
    copies = CopyEngine(torch.device("cpu"), num_streams=1)
    order = []
    first = copies.submit("a", 0, lambda h: order.append("a"), background=True)
    second = copies.submit("b", 0, lambda h: order.append("b"))
    first.synchronize()
    second.synchronize()
    assert order == ["a", "b"]  # one stream: submission order (a tensor-parallel mirror)
    copies.close()


def test_a_deferred_store_ahead_reads_its_pages_when_flushed_after_the_forward():
    # pipelined decode: the step's stores ahead are submitted once its forward is
    # launched (defer_ahead); the forward cannot write their pages, which nobody holds
    kv = make()
    pages, old = running(kv)
    assert kv.swap_out("a", len(TOKENS))
    assert kv.take_step_copies(defer_ahead=True) == []
    assert kv.tier.num_in_flight == 0  # nothing submitted yet
    assert kv.tier.holds(kv.page_hashes("a", TOKENS)[0])  # counted as on its way to host
    kv.flush_ahead()  # after the launch
    assert kv.tier.num_in_flight == 1
    kv.tier.drain()
    assert [torch.equal(h, o) for h, o in zip(on_host(kv), old[:2])] == [True, True]


def test_a_deferred_store_ahead_whose_page_is_reallocated_first_is_read_before_the_write():
    # a later step's schedule evicts the page before the deferred flush ran: the page
    # becomes that step's write-back, read in its flush, before its new owner writes it
    kv = make()
    pages, old = running(kv)
    assert kv.swap_out("a", len(TOKENS))
    assert kv.take_step_copies(defer_ahead=True) == []
    assert kv.allocate("b", kv.num_free_pages * PS)  # the next schedule evicts them
    assert set(pages[:2]) <= set(kv.pages["b"])
    assert kv.take_step_copies(defer_ahead=True) == []  # the write-backs: read here
    for p in kv.pages["b"]:  # the new owner's forward
        kv.tier.device_pool.kv[:, :, p].fill_(3.0)
    kv.flush_ahead()  # nothing left ahead
    kv.tier.drain()
    assert [torch.equal(h, o) for h, o in zip(on_host(kv), old[:2])] == [True, True]
