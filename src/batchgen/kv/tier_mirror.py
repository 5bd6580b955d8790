"""The host tier on a tensor-parallel worker rank: the copies rank 0's tier decided,
replayed on this rank's KV shard (same page ids, its own heads).

    rank 0: TieredKVManager decides            rank r: TierMirror replays
    _submit_store / _submit_load submit on     the step's message carries them, in rank
    rank 0's shard and log a TierCopy   ---->  0's submission order; each goes through
    (plain data: kind, pages, tags)            CopyEngine.submit on this rank's shard
                                               (rules 1-2), before the step's forward,
                                               which waits for all of them (rule 3)

Rank 0 frees and reuses a page when its own copy completes; this rank's copy of the same
page may finish later, or start later (stores rank 0 submits after a forward travel with
the next step's message). What keeps a page from being reused before this rank's copy
read or wrote it:
- one copy stream (the worker's CopyEngine has num_streams=1): the copies run in rank 0's
  submission order, so a copy writing a host or device page runs after every earlier
  copy that read or wrote it. A first increment: on rank 0 loads and stores overlap on
  two streams, here they queue behind each other;
- the step's forward waits for every copy of its message (a load's pages layer by layer,
  a store's source pages read), so compute never writes a device page a copy has yet to
  read nor reads one a load has yet to write;
- a load waits for the stores in flight that write its host pages, as on rank 0.

A model with linear-attention layers also mirrors its state tier's copies ("state_store",
"state_load": one compressed-state slot each way, this rank's heads of it), under the
same rules, through the same stream. The copies in flight are kept in two `CopyLedger`s
(kv/copy_ledger.py), of host pages and of host state slots, as rank 0's tiers keep
theirs; rule numbers are kv/copy_rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.copy_ledger import CopyLedger, readback_pages, readback_slot
from batchgen.kv.copy_ledger import LayerStores as LayerStores  # the records rank 0 sends
from batchgen.kv.copy_ledger import TierCopy as TierCopy
from batchgen.kv.host_pool import HostPool
from batchgen.kv.page_copies import (
    device_to_host_pages,
    device_to_host_state,
    host_to_device_pages,
    host_to_device_state,
    load_buffers,
)
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool, StatePool


@dataclass
class MirrorMetrics:
    """What a worker's mirror really copied (rank 0's TierMetrics count the engine's)."""

    loads: int = 0
    stores: int = 0
    pages_loaded: int = 0
    pages_offloaded: int = 0
    state_stores: int = 0
    state_loads: int = 0
    layer_stores: int = 0  # one layer of a step's decode-filled pages (decode_append="layer")
    readback_checks: int = 0


class TierMirror:
    """A worker rank's host tier: its device pool shard, host pool shard and copy engine,
    issuing what rank 0's tier decided. It decides nothing and allocates nothing."""

    def __init__(
        self,
        device_pool: PagePool,
        host_pool: HostPool,
        copies: CopyEngine,
        debug: bool,
        states: tuple[StatePool, HostStatePool] | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.copies = copies
        self.debug = debug
        self.states = states  # this rank's device and host state pools, if any
        self.metrics = MirrorMetrics()
        # copies in flight: of host pages, of host state slots (rank 0 frees them)
        self.ledger = CopyLedger()
        self.slot_ledger = CopyLedger()
        # per-layer stores issued inside a forward: the next step's forward waits for them
        # before it can write a page they read (rank 0 may have freed and reused it)
        self._layer_stores: list[CopyHandle] = []
        self._by_kind = {
            "store": self._store,
            "load": self._load,
            "state_store": self._state_store,
            "state_load": self._state_load,
        }

    def attach_device(self, pool: PagePool | None) -> None:
        """Point at this rank's re-created device pool (None while it is replaced)."""
        self.device_pool = pool

    def issue(self, copies: list[TierCopy], forward: bool = True) -> list[CopyHandle]:
        """Submit `copies` in order; the handles the step's forward must wait on (all:
        a load layer by layer, a store until its source pages are read, a state copy
        whole), and with `forward` (a forward follows) the per-layer stores earlier
        forwards issued (whole); without, those wait for the next forward."""
        self.poll()
        earlier = []
        if forward:
            earlier, self._layer_stores = self._layer_stores, []
        return earlier + [self._by_kind[c.kind](c) for c in copies]

    def store_layer(self, plan: LayerStores, layer: int) -> None:
        """decode_append="layer", inside this rank's forward right after layer `layer`
        wrote its K/V: copy that layer of the plan's pages (this rank's heads) to their
        host pages, ordered after the write (the copy engine's producer event)."""
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        dev_pages, host_pages = plan.dev_pages, plan.host_pages
        layers = range(layer, layer + 1)
        handle = self.copies.submit(
            "store",
            len(dev_pages) * self.device_pool.layout.bytes_per_page // dev_kv.shape[0],
            lambda h: device_to_host_pages(dev_kv, host_kv, dev_pages, host_pages, layers),
        )
        self.ledger.record_store(handle, host_pages)
        self.ledger.add_store(handle, host_pages)
        self._layer_stores.append(handle)
        self.metrics.layer_stores += 1
        if layer == dev_kv.shape[0] - 1:
            self.metrics.pages_offloaded += len(dev_pages)
        if self.debug:
            self._readback(dev_pages, host_pages, handle, plan.tags, layers)

    def _store(self, c: TierCopy) -> CopyHandle:
        dev_pages, host_pages = c.dev_pages, c.host_pages
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        handle = self.copies.submit(
            "store",
            len(dev_pages) * self.device_pool.layout.bytes_per_page,
            lambda h: device_to_host_pages(
                dev_kv, host_kv, dev_pages, host_pages, on_read=lambda: h.mark(0)
            ),
            num_gates=1,
        )
        self.ledger.record_store(handle, host_pages)
        self.ledger.add_store(handle, host_pages)
        self.metrics.stores += 1
        self.metrics.pages_offloaded += len(dev_pages)
        if self.debug:
            self._readback(dev_pages, host_pages, handle, c.tags)
        return handle

    def _load(self, c: TierCopy) -> CopyHandle:
        host_pages, dev_pages = c.host_pages, c.dev_pages
        after = self.ledger.stores_of(host_pages)
        host_kv, dev_kv = self.host_pool.kv, self.device_pool.kv
        buffers = load_buffers(host_kv, dev_kv, host_pages, dev_pages)  # on this stream

        def copy(handle: CopyHandle):
            for store in after:  # a host page is not read before its write completes (3a)
                store.wait_on_current_stream()
            return host_to_device_pages(
                host_kv, dev_kv, host_pages, dev_pages, handle.mark, buffers=buffers
            )

        handle = self.copies.submit(
            "load",
            len(host_pages) * self.device_pool.layout.bytes_per_page,
            copy,
            num_gates=dev_kv.shape[0],
        )
        self.ledger.add_load(handle, host_pages)
        self.metrics.loads += 1
        self.metrics.pages_loaded += len(host_pages)
        return handle

    def _state_tensors(self) -> tuple[tuple, tuple]:
        if self.states is None:
            raise RuntimeError("a state copy was mirrored to a rank without a state pool")
        dev, host = self.states
        return (dev.states, dev.windows), (host.states, host.windows)

    def _state_store(self, c: TierCopy) -> CopyHandle:
        dev, host = self._state_tensors()
        dev_slots, host_slots = c.dev_pages, c.host_pages
        handle = self.copies.submit(
            "store",
            self.states[0].layout.bytes_per_slot,
            lambda h: device_to_host_state(dev, host, dev_slots, host_slots),
        )
        self.slot_ledger.record_store(handle, host_slots)
        self.slot_ledger.add_store(handle, host_slots)
        self.metrics.state_stores += 1
        if self.debug:
            self._readback_state(dev_slots[0], host_slots[0], handle, c.tags[0])
        return handle

    def _state_load(self, c: TierCopy) -> CopyHandle:
        dev, host = self._state_tensors()
        host_slots, dev_slots = c.host_pages, c.dev_pages
        after = self.slot_ledger.stores_of(host_slots)

        def copy(handle: CopyHandle):
            for store in after:  # a host slot is not read before its write completes (3a)
                store.wait_on_current_stream()
            return host_to_device_state(host, dev, host_slots, dev_slots)

        handle = self.copies.submit("load", self.states[0].layout.bytes_per_slot, copy)
        self.slot_ledger.add_load(handle, host_slots)
        self.metrics.state_loads += 1
        return handle

    def poll(self) -> None:
        """Forget the copies that completed (their tensors are released); a copy that
        failed raises here."""
        self.ledger.poll()
        self.slot_ledger.poll()

    def drain(self) -> None:
        self.ledger.drain()
        self.slot_ledger.drain()

    def _readback(
        self, dev_pages, host_pages, handle: CopyHandle, tags, layers: range | None = None
    ) -> None:
        """batchgen_debug: wait for the store and compare each host page of this rank's
        shard with its device source, over `layers` (None: every layer; nothing has
        written the source since the copy was issued)."""
        if layers is None:
            layers = range(self.device_pool.kv.shape[0])
        readback_pages(
            handle,
            self.device_pool,
            self.host_pool,
            dev_pages,
            host_pages,
            tags,
            layers,
            self.metrics,
        )

    def _readback_state(self, dev_slot: int, host_slot: int, handle: CopyHandle, tag) -> None:
        """batchgen_debug: wait for the state store and compare this rank's host slot
        with its device source (one check: its state and conv window, as rank 0)."""
        dev, host = self.states
        readback_slot(
            handle, dev, host, dev_slot, host_slot, f"{tag} (this rank's heads)", self.metrics
        )
