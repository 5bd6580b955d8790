"""The copy-ordering rules (kv/copy_rules.py) on the CPU, for each policy over the copy
ledger (kv/copy_ledger.py): the page tier, the state tier's slots, and a tensor-parallel
worker's mirror of both. Rule 3a's scenario runs on all four, parametrised; the others
are where one policy has a path of its own (write-backs, gathers, deferred scatters).

On the CPU each copy stream has its own worker thread, so copies on two streams run
concurrently: a missing wait between them is seen here, not only on a GPU. The GPU twin,
test_copy_ordering_gpu.py, holds a stream back with a spin kernel and removes rule 2 or
a rule-3 wait to show each is needed."""

from __future__ import annotations

import threading

import pytest
import torch
from tier_parts import STATE_LAYOUT, block_streams, make_state_tier

import batchgen.kv.copy_ledger as copy_ledger
from batchgen.kv import page_copies
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.copy_ledger import TierCopy
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool, StatePool
from batchgen.kv.tier_mirror import TierMirror
from batchgen.kv.tiered import TieredKVManager

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)
PAUSE = 0.3  # seconds a copy that must wait is given to (wrongly) run
CPU = torch.device("cpu")


def make_pages(dev_pages=6, host_pages=4, debug=False, load_scatter="copy"):
    pool = PagePool(LAYOUT, dev_pages, CPU)
    pool.kv.normal_()
    alloc = PageAllocator(dev_pages)
    host = HostPool(LAYOUT, host_pages, pin=False)
    host.kv.fill_(-1.0)  # a page nothing wrote reads -1
    copies = CopyEngine(CPU)
    tier = TieredKVManager(pool, host, alloc, copies, debug=debug, load_scatter=load_scatter)
    return tier, alloc


def make_mirror():
    """A worker's mirror with two copy streams (a worker has one, which orders its copies
    by itself: two let a missing rule-3a wait show)."""
    dev, host = StatePool(STATE_LAYOUT, 3, "cpu"), HostStatePool(STATE_LAYOUT, 2, pin=False)
    dev.states.normal_()
    dev.windows.normal_()
    pool = PagePool(LAYOUT, 6, CPU)
    pool.kv.normal_()
    copies = CopyEngine(CPU, num_streams=2)
    return TierMirror(pool, HostPool(LAYOUT, 4, pin=False), copies, False, (dev, host))


def device_page(tier, page):
    return tier.device_pool.kv[:, :, page]  # [L, 2, S, H, D]


def source(tier, slot):
    pool = tier.device_pool
    return pool.states[:, slot].clone(), pool.windows[:, slot].clone()


# --- rule 3a: a load waits for the stores of its host pages or slots, every policy -----


def _pages_store_then_load(tier, alloc):
    src = alloc.allocate(1)
    tier.queue_store(src, [b"x"], "write_through", "r")
    tier.flush()
    host = tier.host_alloc.lookup([b"x"])  # in flight, and found already
    dst = alloc.allocate(1)
    tier.queue_load(host, dst, "prefix_load", "r")
    (load,) = tier.flush()
    return load, lambda: torch.equal(device_page(tier, dst[0]), device_page(tier, src[0]))


def _slots_store_then_load(tier, slots):
    slot = slots.take("r")
    want = source(tier, slot)
    tier.store("r", "request r")
    load = tier.load("r")  # on the other, free stream

    def landed():
        back = slots.slot("r")
        return torch.equal(tier.device_pool.states[:, back], want[0]) and torch.equal(
            tier.device_pool.windows[:, back], want[1]
        )

    return load, landed


def _mirror_pages_store_then_load(mirror):
    (_,) = mirror.issue([TierCopy("store", [1], [2], ["r"])], forward=False)
    (load,) = mirror.issue([TierCopy("load", [4], [2], ["r"])], forward=False)
    return load, lambda: torch.equal(device_page(mirror, 4), device_page(mirror, 1))


def _mirror_slots_store_then_load(mirror):
    dev = mirror.states[0]
    want = dev.states[:, 0].clone(), dev.windows[:, 0].clone()
    (_,) = mirror.issue([TierCopy("state_store", [0], [1], ["r"])], forward=False)
    (load,) = mirror.issue([TierCopy("state_load", [2], [1], ["r"])], forward=False)
    return (
        load,
        lambda: torch.equal(dev.states[:, 2], want[0]) and torch.equal(dev.windows[:, 2], want[1]),
    )


SIDES = {
    "pages": (make_pages, _pages_store_then_load),
    "slots": (make_state_tier, _slots_store_then_load),
    "mirror-pages": (lambda: (make_mirror(),), _mirror_pages_store_then_load),
    "mirror-slots": (lambda: (make_mirror(),), _mirror_slots_store_then_load),
}


@pytest.mark.parametrize("side", list(SIDES))
def test_a_load_waits_for_the_store_writing_its_host_pages_or_slots(side):
    """The store goes to a blocked copy stream, the load of its host page (or slot) to
    the free one: the load must wait for the store on its stream, then read what the
    store wrote."""
    make, store_then_load = SIDES[side]
    made = make()
    tier = made[0]
    release = block_streams(tier, streams=1)  # blocks the stream the store will go to
    tier.copies.submit("spacer", 0, lambda h: None)  # the load goes to the free stream
    load, landed = store_then_load(*made)
    assert not load.completed.wait(PAUSE), "the load ran before the store wrote its source"
    release.set()
    tier.drain()
    assert landed()


# --- rules 3d and 5: what a copy reads or writes is held until it completes ------------


def test_store_holds_its_pages_until_it_completes_and_registers_host_pages_at_once():
    tier, alloc = make_pages()
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


def test_load_holds_host_and_destination_pages_until_it_completes():
    tier, alloc = make_pages()
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


def test_write_back_copies_an_evicted_page_before_its_new_owner_writes_it():
    tier, alloc = make_pages()
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


@pytest.mark.parametrize("scatter", ["copy", "compute"])
def test_where_a_write_through_store_reads_its_pages(scatter, monkeypatch):
    """A write-through store's held pages are read by its copy on the copy stream
    ("copy"), or gathered at the flush in the submitting stream's order ("compute": the
    page tier runs no kernel on a copy stream). The page is written again between the
    flush and the copy, which a blocked stream holds back: the host page shows which
    read happened."""
    tier, alloc = make_pages(load_scatter=scatter)
    copy_stream_reads = []
    real = page_copies.device_to_host_pages

    def counted(*args, **kwargs):
        copy_stream_reads.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr("batchgen.kv.copy_ledger.device_to_host_pages", counted)
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


def test_the_device_slot_is_not_reused_before_its_store_completes():
    tier, slots = make_state_tier(dev_slots=2)
    slot = slots.take("r")
    want = source(tier, slot)
    release = block_streams(tier)
    tier.store("r", "request r")
    assert not slots.holds("r") and slots.num_free == 1  # detached, not free
    other = slots.take("s")
    assert other != slot
    with pytest.raises(RuntimeError):
        slots.take("t")  # the only other slot is still being read
    tier.poll()
    assert tier.num_in_flight == 1 and slots.num_free == 0  # blocked: nothing completes
    release.set()
    tier.drain()
    assert slots.num_free == 1 and slots.take("t") == slot
    host = tier._owned["r"]
    assert torch.equal(tier.host_pool.states[:, host], want[0])
    assert torch.equal(tier.host_pool.windows[:, host], want[1])


@pytest.mark.parametrize("scatter", ["copy", "compute"])
def test_where_a_state_store_and_a_checkpoint_read_their_slots(scatter, monkeypatch):
    """A swap-out store and a checkpoint read their device slots in their copy, on the
    copy stream ("copy"), or at submission in the submitting stream's order ("compute":
    the tier runs no kernel on a copy stream). Each slot is written again between the
    submission and the copy, which a blocked stream holds back: the host slots show
    which read happened. Either way the checkpoint's gate is marked and its handle done."""
    tier, slots = make_state_tier(load_scatter=scatter)
    copy_stream_reads = []
    real = copy_ledger.device_to_host_state
    monkeypatch.setattr(
        copy_ledger,
        "device_to_host_state",
        lambda *a, **k: copy_stream_reads.append(a[2]) or real(*a, **k),
    )
    stored, kept = slots.take("r"), slots.take("s")
    at_submit = {s: source(tier, s) for s in (stored, kept)}
    release = block_streams(tier)
    tier.store("r", "request r")
    kept_host = tier.take_host_slot()
    checkpoint = tier.checkpoint_out(kept, kept_host, "request s")
    for s in (stored, kept):  # later writes, ahead of the blocked copies
        tier.device_pool.states[:, s] += 1.0
        tier.device_pool.windows[:, s] += 1.0
    later = {s: source(tier, s) for s in (stored, kept)}
    release.set()
    tier.drain()
    want = at_submit if scatter == "compute" else later
    for s, host in ((stored, tier._owned["r"]), (kept, kept_host)):
        assert torch.equal(tier.host_pool.states[:, host], want[s][0]), s
        assert torch.equal(tier.host_pool.windows[:, host], want[s][1]), s
    assert sorted(copy_stream_reads) == ([] if scatter == "compute" else sorted([[stored], [kept]]))
    assert checkpoint.gates[0].event.is_set() and checkpoint.is_done()


def test_a_checkpoint_frees_its_slot_for_writing_once_read_into_staging():
    """The step after a checkpoint waits only on the handle's one gate (wait_layer and
    wait_gates take gate 0), which the copy marks once the slot is gathered into staging:
    a write to the slot from then on (done here at the gate itself) leaves the host slot
    with the state as it was. A gate marked before the gather would let it through.
    (On the CPU a copy is issued whole before any gate can be awaited; the GPU's events
    let the forward start while the transfer to host runs.)"""
    tier, slots = make_state_tier()
    slot = slots.take("r")
    want = source(tier, slot)
    dev, host = tier._tensors()
    host_slot = tier.take_host_slot()

    def overwrite():  # the next step's forward, at the gate
        dev[0][:, slot] = 7.0
        dev[1][:, slot] = 7.0

    page_copies.device_to_host_state(dev, host, [slot], [host_slot], on_read=overwrite)
    assert torch.equal(tier.device_pool.states[:, slot], torch.full_like(want[0], 7.0))
    assert torch.equal(tier.host_pool.states[:, host_slot], want[0])
    assert torch.equal(tier.host_pool.windows[:, host_slot], want[1])
    # checkpoint_out hands the gate over: one gate, marked by the time the copy is done
    handle = tier.checkpoint_out(slots.take("s"), tier.take_host_slot(), "request s")
    tier.drain()
    assert len(handle.gates) == 1 and handle.gates[0].event.is_set()


# --- rules 3b and 5: a load's scatter deferred to the compute stream ---------------------


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
    tier, alloc = make_pages(load_scatter="compute")
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


def _swapped(tier, slots):
    """A request's slot stored to host and the device slots zeroed since: its values."""
    slots.take("other")
    want = source(tier, slots.take("r"))
    tier.store("r", "request r")
    tier.drain()
    tier.device_pool.states.zero_()
    tier.device_pool.windows.zero_()
    return want


def test_a_deferred_state_load_scatters_at_its_first_wait():
    """load_scatter="compute": the slot's staged values reach the pool only when the
    step resuming the request waits on the load, and the load is not done before."""
    tier, slots = make_state_tier(load_scatter="compute")
    want = _swapped(tier, slots)
    load = tier.load("r")
    load.issued.wait(10)
    back = slots.slot("r")
    assert load.has_deferred and not load.is_done()
    assert tier.device_pool.states[:, back].abs().sum() == 0  # staged, not scattered
    load.wait_layer(0)  # the forward's first layer: a load without gates waits whole
    assert not load.has_deferred
    assert torch.equal(tier.device_pool.states[:, back], want[0])
    assert torch.equal(tier.device_pool.windows[:, back], want[1])
    tier.drain()
    assert tier.host_room == 2


def _pages_load_a_failed_step_left():
    tier, alloc = make_pages(load_scatter="compute")
    host, want = _stored_page(tier, alloc, b"q")
    (dst,) = alloc.allocate(1)
    tier.queue_load([host], [dst], "swap_in", "r")
    (load,) = tier.flush()
    alloc.free([dst])  # the step failed and its request was aborted
    assert alloc.ref_count[dst] == 1  # held by the load
    landed = lambda: torch.equal(device_page(tier, dst), want)  # noqa: E731
    return tier, load, landed, lambda: alloc.ref_count[dst] == 0


def _slots_load_a_failed_step_left():
    tier, slots = make_state_tier(load_scatter="compute")
    want = _swapped(tier, slots)
    load = tier.load("r")  # nobody waits on it: its step failed
    landed = lambda: torch.equal(tier.device_pool.states[:, slots.slot("r")], want[0])  # noqa: E731
    return tier, load, landed, lambda: tier.host_room == 2  # its host slot back


@pytest.mark.parametrize(
    "left", [_pages_load_a_failed_step_left, _slots_load_a_failed_step_left], ids=["pages", "slots"]
)
def test_poll_runs_the_deferred_scatter_a_failed_step_left(left):
    """A load whose step never ran its forward (it failed after the flush) still writes
    its pages (or slot) before they can go to anyone else: the next poll queues its
    scatter, and the destination stays held until the load completes."""
    tier, load, landed, released = left()
    load.issued.wait(10)
    assert load.has_deferred
    tier.poll()  # the next step's poll: nobody waited on the load
    assert not load.has_deferred
    assert landed()
    tier.drain()
    assert released()


# --- rule 6: no copy overlaps a graph capture ------------------------------------------


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
