"""StateTier: the host tier of compressed-state slots (linear-attention layers), every
copy through the CopyEngine as TieredKVManager's pages are.

    swap-out  store(rid): device slot (detached from the request) -> a free host slot
              one submit, ordered after the compute that wrote the slot (rule 1-2)
    swap-in   load(rid):  host slot -> a device slot taken now; the step that resumes
              the request waits on the returned handle (SchedulerOutput.wait_for)

Who may reuse a slot:
- A store's device slot belongs to no request (StateSlots.detach) and is not free until
  the store completes: no admission can take it, and no step write it, while the copy
  reads it. `_complete` gives it back.
- A host slot belongs to its swapped request from its store to its load. A load of a
  host slot whose store is still in flight waits for that store on the copy stream; the
  host slot is free again only once the load completes. A swapped request that ends
  before its swap-in frees its host slot, after its store completes if it is in flight.
Handles complete in `poll()` / `drain()`, which TieredKVManager's poll and drain call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.page_copies import device_to_host_state, host_to_device_state
from batchgen.kv.state_pool import HostStatePool, StatePool, StateSlots
from batchgen.kv.tier_metrics import TierMetrics
from batchgen.kv.tiered import KVReadbackError


@dataclass
class _Pending:
    handle: CopyHandle
    kind: str  # "store" | "load"
    host_slot: int
    dev_slot: int | None  # a store's detached device slot, given back at completion
    reason: str


class StateTier:
    def __init__(
        self,
        device_pool: StatePool,
        host_pool: HostStatePool,
        slots: StateSlots,
        copies: CopyEngine,
        metrics: TierMetrics,
        debug: bool = False,
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.slots = slots
        self.copies = copies
        self.metrics = metrics  # the page tier's: one report for the whole host tier
        self.debug = debug
        self._free = list(range(host_pool.num_slots - 1, -1, -1))
        self._owned: dict[str, int] = {}  # swapped request -> its host slot
        self._writing: dict[int, CopyHandle] = {}  # host slot -> store in flight
        self._dropped: set[int] = set()  # host slots freed once their store completes
        self._pending: deque[_Pending] = deque()

    @property
    def slot_bytes(self) -> int:
        return self.device_pool.layout.bytes_per_slot

    @property
    def host_room(self) -> int:
        """Host slots a store could take now."""
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        """The request's state is on host (swapped, not loaded back yet)."""
        return request_id in self._owned

    def _tensors(self) -> tuple[tuple, tuple]:
        dev, host = self.device_pool, self.host_pool
        return (dev.states, dev.windows), (host.states, host.windows)

    def store(self, request_id: str, tag: str) -> None:
        """Swap-out: copy the request's device slot (every KDA layer's state and conv
        window) to a free host slot, which it owns until its swap-in. The caller checks
        `host_room`. The device slot leaves the request now and is free again only when
        the copy completes."""
        dev_slots = [self.slots.detach(request_id)]
        host_slots = [self._free.pop()]
        dev, host = self._tensors()
        handle = self.copies.submit(
            "store",
            self.slot_bytes,
            lambda h: device_to_host_state(dev, host, dev_slots, host_slots),
        )
        for s in host_slots:
            self._writing[s] = handle
        self._owned[request_id] = host_slots[0]
        self.metrics.state_swaps_out += 1
        self.metrics.count("state_swap_out", self.slot_bytes)
        self._pending.append(
            _Pending(handle, "store", host_slots[0], dev_slots[0], "state_swap_out")
        )
        if self.debug:
            self._readback(dev_slots[0], host_slots[0], handle, tag)

    def load(self, request_id: str) -> CopyHandle:
        """Swap-in: take a device slot for the request (the caller checks that one is
        free) and load its host slot into it; the step resuming the request waits on
        the handle. The host slot is held until the load completes."""
        host_slots = [self._owned.pop(request_id)]
        dev_slots = [self.slots.take(request_id)]
        after = {self._writing[s] for s in host_slots if s in self._writing}
        dev, host = self._tensors()

        def copy(handle: CopyHandle):
            for store in after:  # a host slot is not read before its write completes
                store.wait_on_current_stream()
            return host_to_device_state(host, dev, host_slots, dev_slots)

        handle = self.copies.submit("load", self.slot_bytes, copy)
        self.metrics.state_swaps_in += 1
        self.metrics.count("state_swap_in", self.slot_bytes)
        self._pending.append(_Pending(handle, "load", host_slots[0], None, "state_swap_in"))
        return handle

    def forget(self, request_id: str) -> None:
        """A swapped request ended before its swap-in: its host slot is free (once its
        store completes)."""
        slot = self._owned.pop(request_id, None)
        if slot is None:
            return
        if slot in self._writing:
            self._dropped.add(slot)
        else:
            self._free.append(slot)

    # ---- completion --------------------------------------------------------------------
    def poll(self) -> None:
        """Complete every copy that has finished, in submission order."""
        while self._pending and self._pending[0].handle.is_done():
            self._complete(self._pending.popleft())

    def drain(self) -> None:
        while self._pending:
            self._complete(self._pending.popleft())

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def _complete(self, p: _Pending) -> None:
        p.handle.synchronize()
        seconds = p.handle.copy_seconds()
        self.metrics.copy_seconds += seconds
        by_reason = self.metrics.seconds_by_reason
        by_reason[p.reason] = by_reason.get(p.reason, 0.0) + seconds
        if p.kind == "store":
            if self._writing.get(p.host_slot) is p.handle:
                del self._writing[p.host_slot]
            self.slots.give_back(p.dev_slot)
            if p.host_slot in self._dropped:
                self._dropped.discard(p.host_slot)
                self._free.append(p.host_slot)
        else:
            self._free.append(p.host_slot)
        p.handle.keep = ()

    def _readback(self, dev_slot: int, host_slot: int, handle: CopyHandle, tag: str) -> None:
        """batchgen_debug: wait for the store and compare the host slot with its device
        source (detached: nothing writes it before the store completes)."""
        handle.synchronize()
        self.metrics.readback_checks += 1
        dev, host = self._tensors()
        for what, src_all, dst_all in zip(("state", "conv window"), dev, host):
            src = src_all[:, dev_slot].cpu()
            dst = dst_all[:, host_slot]
            if not torch.isfinite(dst.float()).all():
                raise KVReadbackError(
                    f"{tag}: non-finite {what} in offloaded state slot {dev_slot}"
                )
            if not torch.equal(src, dst):
                bad = (src != dst).flatten(1).any(-1).nonzero()[0, 0].item()
                raise KVReadbackError(
                    f"{tag}: KDA layer {bad}'s {what} of device state slot {dev_slot} differs "
                    f"from its host copy (host slot {host_slot})"
                )
