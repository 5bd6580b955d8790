"""TieredKVManager bookkeeping on the CPU: pages in flight are never freed, evicted or
reused; a load waits for the store writing its host pages; host LRU order; the copy
worker pauses for graph captures; batchgen_debug readback.

On the CPU each copy stream has its own worker thread, so copies on two streams run
concurrently: a missing wait between them is seen here, not only on a GPU."""

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
PAUSE = 0.3  # seconds a copy that must wait is given to (wrongly) run


def make(dev_pages=6, host_pages=4, debug=False, load_scatter="copy"):
    pool = PagePool(LAYOUT, dev_pages, torch.device("cpu"))
    pool.kv.normal_()
    alloc = PageAllocator(dev_pages)
    host = HostPool(LAYOUT, host_pages, pin=False)
    host.kv.fill_(-1.0)  # a page nothing wrote reads -1
    copies = CopyEngine(torch.device("cpu"))
    tier = TieredKVManager(pool, host, alloc, copies, debug=debug, load_scatter=load_scatter)
    return tier, alloc


def block_streams(tier, streams=None):
    """Queue a task that blocks until the returned event is set on each copy stream (or
    on the next `streams` of them): copies submitted after it on that stream wait."""
    ev = threading.Event()
    for _ in range(streams or len(tier.copies._queues)):
        tier.copies.submit("gate", 0, lambda h: ev.wait(10))
    return ev


def device_page(tier, page):
    return tier.device_pool.kv[:, :, page]  # [L, 2, S, H, D]


def test_store_holds_its_pages_until_it_completes_and_registers_host_pages_at_once():
    tier, alloc = make()
    pages = alloc.allocate(2)
    expected = [device_page(tier, p).clone() for p in pages]
    release = block_streams(tier)
    tier.queue_store(pages, [b"h0", b"h1"], "write_through", "request r")
    tier.flush()
    alloc.free(pages)  # the request lets go; the copy still holds them
    assert all(alloc.ref_count[p] == 1 for p in pages)
    grabbed = alloc.allocate(alloc.num_free)
    assert not set(grabbed) & set(pages)
    in_flight = tier.lookup([b"h0", b"h1"])  # findable at once: a load of it would wait
    assert len(in_flight) == 2 and tier.holds(b"h0")
    with pytest.raises(RuntimeError):
        tier.host_alloc.allocate(tier.host_alloc.num_pages)  # held by the store: kept
    tier.poll()
    assert tier.num_in_flight == 1  # blocked: nothing completes early
    release.set()
    tier.drain()
    assert all(alloc.ref_count[p] == 0 for p in pages)
    host = tier.lookup([b"h0", b"h1"])
    assert len(host) == 2
    for h, want in zip(host, expected):
        assert torch.equal(tier.host_pool.page(h), want)


@pytest.mark.parametrize("scatter", ["copy", "compute"])
def test_where_a_write_through_store_reads_its_pages(scatter, monkeypatch):
    """A write-through store's held pages are read by its copy on the copy stream
    ("copy"), or gathered at the flush in the submitting stream's order ("compute": the
    page tier runs no kernel on a copy stream). The page is written again between the
    flush and the copy, which a blocked stream holds back: the host page shows which
    read happened."""
    tier, alloc = make(load_scatter=scatter)
    copy_stream_reads = []
    real = page_copies.device_to_host_pages

    def counted(*args, **kwargs):
        copy_stream_reads.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr("batchgen.kv.tiered.device_to_host_pages", counted)
    (page,) = alloc.allocate(1)
    at_flush = device_page(tier, page).clone()
    release = block_streams(tier)
    tier.queue_store([page], [b"w"], "write_through", "r")
    tier.flush()
    device_page(tier, page).add_(1.0)  # a later write, ahead of the blocked copy
    later = device_page(tier, page).clone()
    release.set()
    tier.drain()
    (host,) = tier.lookup([b"w"])
    if scatter == "compute":
        assert torch.equal(tier.host_pool.page(host), at_flush)
        assert copy_stream_reads == []
    else:
        assert torch.equal(tier.host_pool.page(host), later)
        assert copy_stream_reads == [[page]]
    assert alloc.ref_count[page] == 1  # held by the store until it completed, either way


def test_load_waits_for_the_store_writing_its_host_pages():
    tier, alloc = make()
    src = alloc.allocate(1)
    release = block_streams(tier, streams=1)  # blocks the stream the store will go to
    tier.copies.submit("spacer", 0, lambda h: None)  # the load goes to the free stream
    tier.queue_store(src, [b"x"], "write_through", "r")
    tier.flush()
    host = tier.host_alloc.lookup([b"x"])  # in flight, and found already
    dst = alloc.allocate(1)
    tier.queue_load(host, dst, "prefix_load", "r")
    (load,) = tier.flush()
    assert not load.completed.wait(PAUSE), "the load ran before the store wrote its page"
    release.set()
    tier.drain()
    assert torch.equal(device_page(tier, dst[0]), device_page(tier, src[0]))


def test_load_holds_host_and_destination_pages_until_it_completes():
    tier, alloc = make()
    tier.queue_store(alloc.allocate(1), [b"p"], "write_through", "r")
    tier.flush()
    tier.drain()
    host = tier.lookup([b"p"])
    dst = alloc.allocate(2)
    release = block_streams(tier)
    tier.queue_load(host, dst[:1], "prefix_load", "r")
    (load,) = tier.flush()
    alloc.free(dst)  # the step failed and its request was aborted
    assert alloc.ref_count[dst[0]] == 1 and alloc.ref_count[dst[1]] == 0
    assert dst[0] not in alloc.allocate(alloc.num_free)  # never handed to someone else
    assert tier.host_alloc.ref_count[host[0]] == 1
    with pytest.raises(RuntimeError):
        tier.host_alloc.allocate(tier.host_alloc.num_pages)  # held: not evictable
    release.set()
    tier.drain()
    assert alloc.ref_count[dst[0]] == 0 and tier.host_alloc.ref_count[host[0]] == 0


def _stored_page(tier, alloc, key: bytes):
    """A device page stored to host under `key` and then overwritten: (host page, the
    page's values as stored)."""
    (src,) = alloc.allocate(1)
    want = device_page(tier, src).clone()
    tier.queue_store([src], [key], "write_through", "r")
    tier.flush()
    tier.drain()
    device_page(tier, src).zero_()
    return tier.lookup([key])[0], want


def test_a_deferred_scatter_runs_layer_by_layer_at_the_waits_once(monkeypatch):
    """tier_load_scatter="compute": the load's staged pages reach the pool only when a
    wait needs their layer, each group once, in order; the copy is not done before."""
    tier, alloc = make(load_scatter="compute")
    host, want = _stored_page(tier, alloc, b"p")
    scattered = []
    real = page_copies._host_to_device_scatter

    def counted(dev_kv, part, idx, group, *a):
        scattered.append(group)
        return real(dev_kv, part, idx, group, *a)

    monkeypatch.setattr(page_copies, "_host_to_device_scatter", counted)
    (dst,) = alloc.allocate(1)
    before = device_page(tier, dst).clone()
    tier.queue_load([host], [dst], "prefix_load", "r")
    (load,) = tier.flush()
    load.issued.wait(10)
    assert load.has_deferred and not load.is_done()
    assert torch.equal(device_page(tier, dst), before)  # staged, not yet in the pool
    load.wait_layer(0)
    assert scattered == [range(0, 1)]
    assert torch.equal(device_page(tier, dst)[0], want[0])
    assert torch.equal(device_page(tier, dst)[1], before[1])  # layer 1 not asked for yet
    load.wait_layer(1)
    load.wait_gates()
    assert scattered == [range(0, 1), range(1, 2)]  # each once
    assert torch.equal(device_page(tier, dst), want)
    tier.drain()
    assert alloc.ref_count[dst] == 1 and scattered == [range(0, 1), range(1, 2)]


def test_poll_runs_the_deferred_scatter_a_failed_step_left():
    """A load whose step never ran its forward (it failed after the flush) still writes
    its pages before they can go to anyone else: the next poll queues its scatter, and
    the destination stays held until then."""
    tier, alloc = make(load_scatter="compute")
    host, want = _stored_page(tier, alloc, b"q")
    (dst,) = alloc.allocate(1)
    tier.queue_load([host], [dst], "swap_in", "r")
    (load,) = tier.flush()
    alloc.free([dst])  # the step failed and its request was aborted
    assert alloc.ref_count[dst] == 1  # held by the load
    load.issued.wait(10)
    assert load.has_deferred
    tier.poll()
    assert not load.has_deferred
    assert torch.equal(device_page(tier, dst), want)
    tier.drain()
    assert alloc.ref_count[dst] == 0


def test_a_bad_load_scatter_is_named():
    with pytest.raises(ValueError, match="load_scatter"):
        make(load_scatter="side")


def test_write_back_copies_an_evicted_page_before_its_new_owner_writes_it():
    tier, alloc = make()
    page = alloc.allocate(1)[0]
    old = device_page(tier, page).clone()
    release = block_streams(tier)
    tier.queue_write_back(page, b"evicted", "write_back", "a cached prefix page")
    assert tier.flush() == []  # read by the flush itself: the forward waits on nothing
    assert alloc.ref_count[page] == 1  # not held: the new owner has it already
    device_page(tier, page).fill_(3.0)  # the new owner writes at once
    assert tier.num_in_flight == 1  # before the transfer ran
    release.set()
    tier.drain()
    assert torch.equal(tier.host_pool.page(tier.lookup([b"evicted"])[0]), old)


def test_host_lru_evicts_the_oldest_cached_page_first():
    tier, alloc = make(host_pages=3)
    dev = alloc.allocate(3)
    for i in range(3):
        tier.queue_store([dev[i]], [bytes([i])], "write_through", "r")
        tier.flush()
        tier.drain()
    assert tier.lookup([bytes([0])]) and tier.lookup([bytes([2])])
    tier.host_alloc.touch(tier.lookup([bytes([0])]))  # page 0 used again: now newest
    tier.host_alloc.free(tier.lookup([bytes([0])]))
    tier.host_alloc.allocate(1)
    assert tier.lookup([bytes([1])]) == []  # the least recently used went first
    assert tier.lookup([bytes([0])]) and tier.lookup([bytes([2])])


def test_a_full_host_pool_offloads_what_fits_and_releases_the_rest():
    tier, alloc = make(host_pages=1)
    pages = alloc.allocate(3)
    assert tier.queue_store(pages, [b"a", b"b", b"c"], "write_through", "r") == 1
    tier.flush()
    tier.drain()
    assert [alloc.ref_count[p] for p in pages] == [1, 1, 1]  # only the owner's references
    assert tier.lookup([b"a"]) and not tier.holds(b"b")


def test_paused_blocks_new_copies_and_waits_for_the_one_issuing():
    engine = CopyEngine(torch.device("cpu"))
    running, release = threading.Event(), threading.Event()
    engine.submit("slow", 0, lambda h: (running.set(), release.wait(10)))
    assert running.wait(5)
    entered = threading.Event()

    def pause():
        with engine.paused():
            entered.set()
            ran = engine.submit("queued", 0, lambda h: None)
            ran2 = engine.submit("queued", 0, lambda h: None)
            assert not ran.completed.wait(PAUSE) and not ran2.completed.wait(0)
        ran.synchronize()
        ran2.synchronize()

    t = threading.Thread(target=pause)
    t.start()
    assert not entered.wait(PAUSE), "paused() returned while a copy was being issued"
    release.set()
    t.join(10)
    assert entered.is_set() and not t.is_alive()


def test_inline_issue_is_for_cuda_copies_only_and_a_bad_mode_is_named():
    """On the CPU a copy runs where it is issued, so "inline" would make it synchronous:
    the CPU engine keeps its workers (copies on two streams stay concurrent)."""
    engine = CopyEngine(torch.device("cpu"), issue="inline")
    assert not engine.inline
    caller = threading.current_thread()
    ran_on = []
    engine.submit("t", 0, lambda h: ran_on.append(threading.current_thread())).synchronize()
    assert ran_on and ran_on[0] is not caller
    with pytest.raises(ValueError, match="issue must be 'worker' or 'inline'"):
        CopyEngine(torch.device("cpu"), issue="thread")


def test_debug_readback_names_request_layer_and_page(monkeypatch):
    tier, alloc = make(debug=True)
    pages = alloc.allocate(1)
    real = page_copies.device_to_host_pages

    def corrupting(dev_kv, host_kv, dev_pages, host_pages, *args, **kw):
        kept = real(dev_kv, host_kv, dev_pages, host_pages, *args, **kw)
        host_kv[1, host_pages[0], 0, 0, 0, 0] += 1.0  # layer 1 differs
        return kept

    monkeypatch.setattr("batchgen.kv.tiered.device_to_host_pages", corrupting)
    tier.queue_store(pages, [b"q"], "write_through", "request r7")
    with pytest.raises(KVReadbackError, match=r"request r7: layer 1 of device page \d+"):
        tier.flush()


def test_debug_readback_catches_non_finite_pages():
    tier, alloc = make(debug=True)
    pages = alloc.allocate(1)
    tier.device_pool.kv[0, 1, pages[0], 2] = float("nan")
    tier.queue_store(pages, [b"n"], "write_through", "request q")
    with pytest.raises(KVReadbackError, match="request q: non-finite"):
        tier.flush()


def test_no_readback_cost_when_debug_is_off():
    tier, alloc = make(debug=False)
    tier.queue_store(alloc.allocate(1), [b"z"], "write_through", "r")
    tier.flush()
    tier.drain()
    assert tier.metrics.readback_checks == 0 and tier.metrics.pages_offloaded == 1


def test_copy_errors_surface_to_the_waiter():
    engine = CopyEngine(torch.device("cpu"))
    handle = engine.submit("boom", 0, lambda h: 1 / 0, num_gates=1)
    with pytest.raises(RuntimeError, match="boom copy failed"):
        handle.synchronize()
    with pytest.raises(RuntimeError, match="boom copy failed"):
        handle.wait_layer(0)
