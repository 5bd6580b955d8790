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


def make(dev_pages=6, host_pages=4, debug=False, load_scatter="copy"):
    pool = PagePool(LAYOUT, dev_pages, torch.device("cpu"))
    pool.kv.normal_()
    alloc = PageAllocator(dev_pages)
    host = HostPool(LAYOUT, host_pages, pin=False)
    host.kv.fill_(-1.0)  # a page nothing wrote reads -1
    copies = CopyEngine(torch.device("cpu"))
    tier = TieredKVManager(pool, host, alloc, copies, debug=debug, load_scatter=load_scatter)
    return tier, alloc


def test_a_bad_load_scatter_is_named():
    with pytest.raises(ValueError, match="load_scatter"):
        make(load_scatter="side")


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

    monkeypatch.setattr("batchgen.kv.copy_ledger.device_to_host_pages", corrupting)
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
