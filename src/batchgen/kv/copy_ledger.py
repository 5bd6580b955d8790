"""CopyLedger: the bookkeeping of a host tier's copies in flight, one for pages and one
for compressed-state slots, on rank 0 and on every tensor-parallel worker alike. The
policies over it decide what to copy and what a completion releases: the page tier
(kv/tiered.py), the state tier (kv/state_tier.py) and a worker's mirror of rank 0's
copies (kv/tier_mirror.py). Rule numbers are kv/copy_rules.py's.

    policy                                    ledger
    handle = copies.submit(store ...)  --->   record_store(handle, host ids): writing map
    after = ledger.stores_of(host ids) <---   the stores in flight that write them
    handle = copies.submit(load: first wait   (rule 3a: the load's body waits for each,
        for each of `after`, then copy)        whole, on its copy stream)
    ledger.add_store / add_load(handle, ...)  pending queue, in submission order
    poll() / drain()                          completes in order: synchronize, copy
                                              seconds by reason, writing map cleared,
                                              host ids released meanwhile freed, the
                                              policy's `done` (its pages released:
                                              rule 5), the handle's tensors dropped

Rank 0's tiers describe each copy they submit as plain data (`TierCopy`, and a step's
per-layer stores as `LayerStores`); the step's message carries them to the workers, whose
mirrors run them through their own ledgers. `readback_pages` / `readback_slot` are
batchgen_debug's check of a finished store against its source, raising `KVReadbackError`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kv.copy_engine import CopyHandle
from batchgen.kv.host_pool import HostPool
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool, StatePool
from batchgen.kv.tier_metrics import TierMetrics


class KVReadbackError(RuntimeError):
    """batchgen_debug found an offloaded page that differs from its device source."""


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
    done: Callable[[], None] | None  # the policy's release at completion


class CopyLedger:
    """Copies in flight over one space of host ids (host pages, or host state slots).

    `metrics`: where copy seconds are counted by reason (None: not counted). `free`:
    gives host ids back to their pool, for those released while a store writes them.
    `defers`: loads may defer their last part to the submitting stream (CopyHandle.defer),
    which poll() runs for a step that failed before it waited on them."""

    def __init__(
        self,
        metrics: TierMetrics | None = None,
        free: Callable[[list[int]], None] | None = None,
        defers: bool = False,
    ) -> None:
        self.metrics = metrics
        self.free = free
        self.defers = defers
        self.writing: dict[int, CopyHandle] = {}  # host id -> the store in flight writing it
        self._dropped: set[int] = set()  # host ids freed once the store writing them completes
        self._pending: deque[_Entry] = deque()

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
        done: Callable[[], None] | None = None,
    ) -> None:
        """A submitted store of `host_ids` (recorded with record_store), completed in
        submission order: then the writing map's entries for them that are still its
        are cleared, those released meanwhile freed, and `done()` releases what the
        policy held for it (rule 5)."""
        self._pending.append(_Entry(handle, True, host_ids, reasons, done))

    def add_load(
        self,
        handle: CopyHandle,
        host_ids: list[int] | tuple = (),
        reasons: list[str] | tuple = (),
        done: Callable[[], None] | None = None,
    ) -> None:
        """A submitted load of `host_ids`, completed in submission order: then `done()`
        releases what the policy held for it (rule 5)."""
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
            e.done()
        e.handle.release()


def readback_pages(
    handle: CopyHandle,
    device_pool: PagePool,
    host_pool: HostPool,
    dev_pages: list[int],
    host_pages: list[int],
    tags: list,
    layers: range,
    metrics,
) -> None:
    """batchgen_debug: wait for a store, then compare each host page with its device
    source over `layers` (nothing has written the source since the copy was issued: debug
    runs no step ahead), counting each in `metrics.readback_checks`; KVReadbackError on a
    difference."""
    handle.synchronize()
    first, end = layers.start, layers.stop
    for dev, host, tag in zip(dev_pages, host_pages, tags):
        src = device_pool.kv[first:end, :, dev].cpu()
        dst = host_pool.kv[first:end, host]
        metrics.readback_checks += 1
        check_offloaded(src, dst, tag, dev, host, first)


def readback_slot(
    handle: CopyHandle,
    device_pool: StatePool,
    host_pool: HostStatePool,
    dev_slot: int,
    host_slot: int,
    tag,
    metrics,
) -> None:
    """batchgen_debug: wait for a state store, then compare the host slot with its device
    source (states and conv windows), counted as one check; KVReadbackError on a
    difference."""
    handle.synchronize()
    metrics.readback_checks += 1
    src = (device_pool.states[:, dev_slot].cpu(), device_pool.windows[:, dev_slot].cpu())
    dst = (host_pool.states[:, host_slot], host_pool.windows[:, host_slot])
    check_offloaded_state(src, dst, dev_slot, host_slot, tag)


def check_offloaded(src: torch.Tensor, dst: torch.Tensor, tag, dev, host, first_layer) -> None:
    """KVReadbackError unless host copy `dst` of device page `dev` equals `src` (both on
    the host, [layers, ...]) and is finite."""
    if not torch.isfinite(dst.float()).all():
        raise KVReadbackError(f"{tag}: non-finite KV in offloaded device page {dev}")
    if not torch.equal(src, dst):
        bad = (src != dst).flatten(1).any(-1).nonzero()[0, 0].item()
        raise KVReadbackError(
            f"{tag}: layer {first_layer + bad} of device page {dev} differs from its host "
            f"copy (host page {host})"
        )


def check_offloaded_state(src: tuple, dst: tuple, dev_slot: int, host_slot: int, tag) -> None:
    """KVReadbackError unless host slot `host_slot`'s (state, conv window) `dst` equals
    device slot `dev_slot`'s `src` (both on the host, [KDA layers, ...]) and is finite."""
    for what, src_one, dst_one in zip(("state", "conv window"), src, dst):
        if not torch.isfinite(dst_one.float()).all():
            raise KVReadbackError(f"{tag}: non-finite {what} in offloaded state slot {dev_slot}")
        if not torch.equal(src_one, dst_one):
            bad = (src_one != dst_one).flatten(1).any(-1).nonzero()[0, 0].item()
            raise KVReadbackError(
                f"{tag}: KDA layer {bad}'s {what} of device state slot {dev_slot} differs "
                f"from its host copy (host slot {host_slot})"
            )
