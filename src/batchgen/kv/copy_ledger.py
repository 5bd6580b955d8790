"""CopyLedger: the one executor of the host tier's copies, on rank 0 and on every
tensor-parallel worker alike, one ledger over host pages and one over compressed-state
slots. A copy is a plain record (`TierCopy`: kind, device ids, host ids, tags); rank 0's
policies emit them (the page tier, kv/tiered.py; the state tier, kv/state_tier.py), the
step's message carries them to the workers, and every rank runs them here (a worker's
mirror, kv/tier_mirror.py). The policies decide what to copy and what a completion
releases; this module alone submits. Rule numbers are kv/copy_rules.py's.

    store(copy, pools, ...)                   load(copy, pools, ...)
    [gather: device ids read into staging     after = stores_of(host ids)     (3a)
     now, on the submitting stream]           staging and index made now
    handle = copies.submit(body)  (1-2)       handle = copies.submit(body)    (1-2)
      body: wait for `after` (whole), then      body: wait for each of `after`,
      device_to_host*, gate 0 at the read       whole, then host_to_device*, a gate
    record_store(handle, host ids)  (3a)        a layer (or deferred: CopyHandle.defer)
    add_store(...): the pending queue         add_load(...): the pending queue
    [batchgen_debug: readback]

    poll() / drain(): complete in submission order: synchronize, copy seconds by
    reason, the writing map cleared, host ids released meanwhile freed, the policy's
    `done(handle)` (what it held for the copy: rule 5), the handle's tensors dropped.

A step's per-layer stores (decode_append="layer") travel as `LayerStores`; each layer of
them is a store of one layer (`store(..., layers=)`). batchgen_debug's readback is
kv/copy_readback.py's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.copy_readback import readback_pages, readback_slot
from batchgen.kv.page_copies import (
    device_to_host_pages,
    device_to_host_staged,
    device_to_host_state,
    device_to_host_state_staged,
    gather_pages,
    gather_state,
    host_to_device_pages,
    host_to_device_state,
    load_buffers,
)
from batchgen.kv.tier_metrics import TierMetrics

Done = Callable[[CopyHandle], None]


@dataclass(frozen=True)
class TierCopy:
    """One copy rank 0's tier submitted, as plain data the workers replay: a "store"
    (device -> host, every layer) or a "load" (host -> device, every layer) of pages, or
    a "state_store" / "state_load" of compressed-state slots (the page lists then hold
    slot ids)."""

    kind: str
    dev_pages: list[int]
    host_pages: list[int]
    tags: list[str]  # whose page each is, for readback errors


@dataclass(frozen=True)
class LayerStores:
    """decode_append="layer": the full pages a step's decode tokens fill, each layer of
    them copied to host pages rank 0 allocated, right after that layer's K/V write inside
    the forward. Plain data: the step's message carries it (TPStep.layer_stores), and
    each worker copies its own shard of the same pages as its forward runs."""

    dev_pages: list[int]
    host_pages: list[int]
    tags: list[str]


@dataclass
class _Entry:
    handle: CopyHandle
    store: bool  # a store: its host ids are in the writing map until it completes
    host_ids: list[int] | tuple  # the host pages or slots it writes (a store) or reads
    reasons: list[str] | tuple  # its copy seconds split by them
    done: Done | None  # the policy's release at completion


class CopyLedger:
    """Copies in flight over one space of host ids (host pages, or host state slots),
    and the one place they are submitted.

    `copies`: the engine every copy goes through. `metrics`: where copy seconds are
    counted by reason (None: not counted). `free`: gives host ids back to their pool,
    for those released while a store writes them. `defers`: loads may defer their last
    part to the submitting stream (CopyHandle.defer), which poll() runs for a step that
    failed before it waited on them. `checks` (batchgen_debug): each store is read back
    and compared with its source, counted in `checks.readback_checks`; None: no
    readback."""

    def __init__(
        self,
        copies: CopyEngine,
        metrics: TierMetrics | None = None,
        free: Callable[[list[int]], None] | None = None,
        defers: bool = False,
        checks=None,
    ) -> None:
        self.copies = copies
        self.metrics = metrics
        self.free = free
        self.defers = defers
        self.checks = checks
        self.writing: dict[int, CopyHandle] = {}  # host id -> the store in flight writing it
        self._dropped: set[int] = set()  # host ids freed once the store writing them completes
        self._pending: deque[_Entry] = deque()

    # ---- running copy records ----------------------------------------------------------
    def store(
        self,
        copy: TierCopy,
        pools: tuple,
        reasons: list[str] | tuple = (),
        done: Done | None = None,
        gather: bool = False,
        read_gate: bool = False,
        readers: list[CopyHandle] | tuple = (),
        layers: range | None = None,
        background: bool = False,
    ) -> CopyHandle:
        """Submit a store (device -> host) of `copy` between `pools` (device pool, host
        pool: of pages, or of state slots for a "state_store"), record it for the loads
        of its host ids (rule 3a) and queue it for completion. `gather`: the device ids
        are read now, on the submitting stream (ids nobody holds: before anything queued
        later writes them; rule 3d), the copy only carries staging to host; else the
        copy reads them on its stream. `read_gate`: the handle's one gate is marked once
        they are read. `readers`: copies reading the same device ids that this one waits
        for, whole, first. `layers`: pages only, one layer's store of every-layer
        pages (the last layer's completion clears the writing map). `background`: on
        the copy engine's background stream."""
        dev_ids, host_ids = copy.dev_pages, copy.host_pages
        slots = copy.kind.startswith("state")
        dev, host = _tensors(pools, slots)
        num_layers = _num_layers(dev, slots)
        staged = None
        if gather and slots:
            staged = gather_state(dev, dev_ids, host_ids)
        elif gather:
            staged = gather_pages(dev, dev_ids, host_ids)

        def run(handle: CopyHandle):
            for reader in readers:  # the slot is given back only after both read it
                reader.wait_on_current_stream()
            on_read = (lambda: handle.mark(0)) if read_gate else None
            if staged is not None:
                if on_read is not None:
                    on_read()  # read already, in the submitting stream's order
                if slots:
                    return device_to_host_state_staged(staged, host, host_ids)
                return device_to_host_staged(staged, host, host_ids)
            if slots and on_read is None:
                return device_to_host_state(dev, host, dev_ids, host_ids)
            if slots:
                return device_to_host_state(dev, host, dev_ids, host_ids, on_read=on_read)
            return device_to_host_pages(dev, host, dev_ids, host_ids, layers, on_read)

        nbytes = len(dev_ids) * _unit_bytes(pools, slots)
        if layers is not None:
            nbytes //= num_layers
        handle = self.copies.submit(
            "store", nbytes, run, num_gates=int(read_gate), background=background
        )
        self.record_store(handle, host_ids)
        whole = layers is None or layers.stop == num_layers
        self.add_store(handle, host_ids if whole else [], reasons, done)
        if self.checks is not None:
            self._readback(copy, pools, handle, slots, layers or range(num_layers))
        return handle

    def load(
        self,
        copy: TierCopy,
        pools: tuple,
        reasons: list[str] | tuple = (),
        done: Done | None = None,
        defer: bool = False,
    ) -> CopyHandle:
        """Submit a load (host -> device) of `copy` between `pools` (of pages, or of
        state slots for a "state_load"), after the whole of every store in flight that
        writes its host ids (rule 3a), and queue it for completion. Pages: one gate a
        layer, marked a group of layers at a time. `defer`: the scatter into the device
        ids runs on the submitting stream at the first wait for its layers
        (CopyHandle.defer), so no kernel runs on a copy stream."""
        host_ids, dev_ids = copy.host_pages, copy.dev_pages
        slots = copy.kind.startswith("state")
        dev, host = _tensors(pools, slots)
        after = self.stores_of(host_ids)
        # staging and index made here, on the submitting stream: the copy stream
        # allocates nothing (the copy keeps them alive until it completes)
        buffers = None if slots else load_buffers(host, dev, host_ids, dev_ids, whole=defer)

        def run(handle: CopyHandle):
            for store in after:  # a host id is not read before its write completes (3a)
                store.wait_on_current_stream()
            later = handle.defer if defer else None
            if slots:
                return host_to_device_state(
                    host, dev, host_ids, dev_ids, later, handle.consumer if defer else None
                )
            # a destination page a store read before its load: the read was queued on
            # the producer's stream before this copy was submitted
            return host_to_device_pages(
                host,
                dev,
                host_ids,
                dev_ids,
                handle.mark,
                buffers=buffers,
                defer=later,
                consumer=handle.consumer,
            )

        gates = 0 if slots else _num_layers(dev, slots)
        nbytes = len(host_ids) * _unit_bytes(pools, slots)
        handle = self.copies.submit("load", nbytes, run, num_gates=gates)
        self.add_load(handle, host_ids, reasons, done)
        return handle

    def _readback(self, copy: TierCopy, pools: tuple, handle, slots: bool, layers: range):
        """batchgen_debug: wait for the store and compare what it wrote with its device
        source (nothing has written the source since: debug runs no step ahead)."""
        dev, host = pools
        if slots:
            for d, h, tag in zip(copy.dev_pages, copy.host_pages, copy.tags):
                readback_slot(handle, dev, host, d, h, tag, self.checks)
            return
        readback_pages(
            handle, dev, host, copy.dev_pages, copy.host_pages, copy.tags, layers, self.checks
        )

    # ---- bookkeeping -------------------------------------------------------------------
    def record_store(self, handle: CopyHandle, host_ids: list[int]) -> None:
        """`handle` writes `host_ids`: a load of any of them waits for it (rule 3a)."""
        for i in host_ids:
            self.writing[i] = handle

    def stores_of(self, host_ids: list[int]) -> set[CopyHandle]:
        """The stores in flight that write any of `host_ids`: a load of them waits for
        each, whole, on its copy stream before it reads them (rule 3a)."""
        return {self.writing[i] for i in host_ids if i in self.writing}

    def add_store(
        self,
        handle: CopyHandle,
        host_ids: list[int] | tuple = (),
        reasons: list[str] | tuple = (),
        done: Done | None = None,
    ) -> None:
        """A submitted store of `host_ids` (recorded with record_store), completed in
        submission order: then the writing map's entries for them that are still its
        are cleared, those released meanwhile freed, and `done(handle)` releases what the
        policy held for it (rule 5)."""
        self._pending.append(_Entry(handle, True, host_ids, reasons, done))

    def add_load(
        self,
        handle: CopyHandle,
        host_ids: list[int] | tuple = (),
        reasons: list[str] | tuple = (),
        done: Done | None = None,
    ) -> None:
        """A submitted load of `host_ids`, completed in submission order: then
        `done(handle)` releases what the policy held for it (rule 5)."""
        self._pending.append(_Entry(handle, False, host_ids, reasons, done))

    def release(self, host_id: int) -> None:
        """A host id is let go of: freed now, or once the store writing it completes."""
        if host_id in self.writing:
            self._dropped.add(host_id)
        else:
            self.free([host_id])

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def poll(self) -> None:
        """Complete every copy that has finished, in submission order (a copy that
        failed raises here). A load's part deferred to the submitting stream runs at its
        step's forward; one a failed step left is queued here first, before anything can
        reuse its pages."""
        if self.defers:
            for e in self._pending:
                if e.handle.issued.is_set() and e.handle.has_deferred:
                    e.handle.run_finishers()
        while self._pending and self._pending[0].handle.is_done():
            self._complete(self._pending.popleft())

    def drain(self) -> None:
        """Wait for and complete every copy in flight."""
        while self._pending:
            self._complete(self._pending.popleft())

    def _complete(self, e: _Entry) -> None:
        e.handle.synchronize()
        if self.metrics is not None:
            seconds = e.handle.copy_seconds()
            self.metrics.copy_seconds += seconds
            by_reason = self.metrics.seconds_by_reason
            for reason in e.reasons:  # a task moves pages of equal size: split its time
                by_reason[reason] = by_reason.get(reason, 0.0) + seconds / len(e.reasons)
        dropped = []
        for i in e.host_ids if e.store else ():
            if self.writing.get(i) is e.handle:
                del self.writing[i]
            if i in self._dropped:
                self._dropped.discard(i)
                dropped.append(i)
        if dropped:
            self.free(dropped)
        if e.done is not None:
            e.done(e.handle)
        e.handle.release()


def _tensors(pools: tuple, slots: bool) -> tuple:
    """The device and host tensors a copy between `pools` moves: the KV arrays of
    pages, or (states, conv windows) of state slots."""
    dev, host = pools
    if slots:
        return (dev.states, dev.windows), (host.states, host.windows)
    return dev.kv, host.kv


def _num_layers(dev, slots: bool) -> int:
    return dev[0].shape[0] if slots else dev.shape[0]


def _unit_bytes(pools: tuple, slots: bool) -> int:
    layout = pools[0].layout
    return layout.bytes_per_slot if slots else layout.bytes_per_page
