"""The host tier on a tensor-parallel worker rank: the copies rank 0's tier decided,
replayed on this rank's KV shard (same page ids, its own heads).

    rank 0: TieredKVManager decides            rank r: TierMirror replays
    each copy, emits it as a TierCopy   ---->  the step's message carries them, in rank
    (plain data: kind, pages, tags) and        0's submission order; each runs through
    runs it through its CopyLedger             this rank's CopyLedger, the same executor
                                               (rules 1-2, 3a), on this rank's shard,
                                               before the step's forward, which waits
                                               for all of them (rule 3)

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
same rules, through the same stream. The copies run through two `CopyLedger`s
(kv/copy_ledger.py), of host pages and of host state slots, as rank 0's tiers run
theirs: this module only picks how each kind runs here (a store's gate marked once its
source pages are read; no scatter deferred); rule numbers are kv/copy_rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.copy_ledger import CopyLedger
from batchgen.kv.copy_ledger import LayerStores as LayerStores  # the records rank 0 sends
from batchgen.kv.copy_ledger import TierCopy as TierCopy
from batchgen.kv.host_pool import HostPool
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
        checks = self.metrics if debug else None  # batchgen_debug: each store read back
        self.ledger = CopyLedger(copies, checks=checks)
        self.slot_ledger = CopyLedger(copies, checks=checks)
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
        handle = self.ledger.store(
            TierCopy("store", plan.dev_pages, plan.host_pages, plan.tags),
            self._pools(),
            layers=range(layer, layer + 1),
        )
        self._layer_stores.append(handle)
        self.metrics.layer_stores += 1
        if layer == self.device_pool.kv.shape[0] - 1:
            self.metrics.pages_offloaded += len(plan.dev_pages)

    def _pools(self) -> tuple[PagePool, HostPool]:
        return self.device_pool, self.host_pool

    def _store(self, c: TierCopy) -> CopyHandle:
        # the forward waits for the gate, marked once the source pages are read
        handle = self.ledger.store(c, self._pools(), read_gate=True)
        self.metrics.stores += 1
        self.metrics.pages_offloaded += len(c.dev_pages)
        return handle

    def _load(self, c: TierCopy) -> CopyHandle:
        handle = self.ledger.load(c, self._pools())
        self.metrics.loads += 1
        self.metrics.pages_loaded += len(c.host_pages)
        return handle

    def _state_pools(self) -> tuple[StatePool, HostStatePool]:
        if self.states is None:
            raise RuntimeError("a state copy was mirrored to a rank without a state pool")
        return self.states

    def _state_store(self, c: TierCopy) -> CopyHandle:
        tags = [f"{tag} (this rank's heads)" for tag in c.tags]  # for readback errors
        handle = self.slot_ledger.store(
            TierCopy(c.kind, c.dev_pages, c.host_pages, tags), self._state_pools()
        )
        self.metrics.state_stores += 1
        return handle

    def _state_load(self, c: TierCopy) -> CopyHandle:
        handle = self.slot_ledger.load(c, self._state_pools())
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
