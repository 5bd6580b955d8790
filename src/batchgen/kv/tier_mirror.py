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
same rules, through the same stream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from batchgen.kv.copy_engine import CopyEngine, CopyHandle
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


def check_offloaded_state(dev: tuple, host: tuple, dev_slot: int, host_slot: int, tag) -> None:
    """KVReadbackError unless host slot `host_slot` of `host` (states, windows) equals
    device slot `dev_slot` of `dev` and is finite."""
    for what, src_all, dst_all in zip(("state", "conv window"), dev, host):
        src = src_all[:, dev_slot].cpu()
        dst = dst_all[:, host_slot]
        if not torch.isfinite(dst.float()).all():
            raise KVReadbackError(f"{tag}: non-finite {what} in offloaded state slot {dev_slot}")
        if not torch.equal(src, dst):
            bad = (src != dst).flatten(1).any(-1).nonzero()[0, 0].item()
            raise KVReadbackError(
                f"{tag}: KDA layer {bad}'s {what} of device state slot {dev_slot} differs "
                f"from its host copy (host slot {host_slot})"
            )


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
        # (handle, host pages it writes, host state slots it writes)
        self._in_flight: deque[tuple[CopyHandle, list[int], list[int]]] = deque()
        self._writing: dict[int, CopyHandle] = {}  # host page -> store in flight
        self._writing_slot: dict[int, CopyHandle] = {}  # host state slot -> store
        # per-layer stores issued inside a forward: the next step's forward waits for them
        # before it can write a page they read (rank 0 may have freed and reused it)
        self._layer_stores: list[CopyHandle] = []
        self._by_kind = {
            "store": self._store,
            "load": self._load,
            "state_store": self._state_store,
            "state_load": self._state_load,
        }

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
        for p in host_pages:
            self._writing[p] = handle
        self._in_flight.append((handle, host_pages, []))
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
        for p in host_pages:
            self._writing[p] = handle
        self._in_flight.append((handle, host_pages, []))
        self.metrics.stores += 1
        self.metrics.pages_offloaded += len(dev_pages)
        if self.debug:
            self._readback(dev_pages, host_pages, handle, c.tags)
        return handle

    def _load(self, c: TierCopy) -> CopyHandle:
        host_pages, dev_pages = c.host_pages, c.dev_pages
        after = {self._writing[p] for p in host_pages if p in self._writing}
        host_kv, dev_kv = self.host_pool.kv, self.device_pool.kv
        buffers = load_buffers(host_kv, dev_kv, host_pages, dev_pages)  # on this stream

        def copy(handle: CopyHandle):
            for store in after:  # a host page is not read before its write completes
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
        self._in_flight.append((handle, [], []))
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
        for s in host_slots:
            self._writing_slot[s] = handle
        self._in_flight.append((handle, [], host_slots))
        self.metrics.state_stores += 1
        if self.debug:
            self._readback_state(dev_slots[0], host_slots[0], handle, c.tags[0])
        return handle

    def _state_load(self, c: TierCopy) -> CopyHandle:
        dev, host = self._state_tensors()
        host_slots, dev_slots = c.host_pages, c.dev_pages
        after = {self._writing_slot[s] for s in host_slots if s in self._writing_slot}

        def copy(handle: CopyHandle):
            for store in after:  # a host slot is not read before its write completes
                store.wait_on_current_stream()
            return host_to_device_state(host, dev, host_slots, dev_slots)

        handle = self.copies.submit("load", self.states[0].layout.bytes_per_slot, copy)
        self._in_flight.append((handle, [], []))
        self.metrics.state_loads += 1
        return handle

    def poll(self) -> None:
        """Forget the copies that completed (their tensors are released); a copy that
        failed raises here."""
        while self._in_flight and self._in_flight[0][0].is_done():
            self._complete(*self._in_flight.popleft())

    def drain(self) -> None:
        while self._in_flight:
            self._complete(*self._in_flight.popleft())

    def _complete(self, handle: CopyHandle, host_pages: list[int], host_slots: list[int]) -> None:
        handle.synchronize()
        for p in host_pages:
            if self._writing.get(p) is handle:
                del self._writing[p]
        for slot in host_slots:
            if self._writing_slot.get(slot) is handle:
                del self._writing_slot[slot]
        handle.keep = ()

    def _readback(
        self, dev_pages, host_pages, handle: CopyHandle, tags, layers: range | None = None
    ) -> None:
        """batchgen_debug: wait for the store and compare each host page of this rank's
        shard with its device source, over `layers` (None: every layer; nothing has
        written the source since the copy was issued)."""
        handle.synchronize()
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        if layers is None:
            layers = range(dev_kv.shape[0])
        first, end = layers.start, layers.stop
        for dev, host, tag in zip(dev_pages, host_pages, tags):
            self.metrics.readback_checks += 1
            src = dev_kv[first:end, :, dev].cpu()
            check_offloaded(src, host_kv[first:end, host], tag, dev, host, first)

    def _readback_state(self, dev_slot: int, host_slot: int, handle: CopyHandle, tag) -> None:
        """batchgen_debug: wait for the state store and compare this rank's host slot
        with its device source."""
        handle.synchronize()
        dev, host = self._state_tensors()
        self.metrics.readback_checks += 1  # one slot (its state and conv window), as rank 0
        check_offloaded_state(dev, host, dev_slot, host_slot, f"{tag} (this rank's heads)")
