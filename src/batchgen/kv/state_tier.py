"""StateTier: the host tier of compressed-state slots (linear-attention layers), every
copy through the CopyEngine as TieredKVManager's pages are.

    swap-out  store(rid): device slot (detached from the request) -> a free host slot
              one submit, ordered after the compute that wrote the slot (rule 1-2)
    swap-in   load(rid):  host slot -> a device slot taken now; the step that resumes
              the request waits on the returned handle (StepCopies.wait_for)

Who may reuse a slot:
- A store's device slot belongs to no request (StateSlots.detach) and is not free until
  the store completes: no admission can take it, and no step write it, while the copy
  reads it. `_complete` gives it back.
- A host slot belongs to its swapped request from its store to its load. A load of a
  host slot whose store is still in flight waits for that store on the copy stream; the
  host slot is free again only once the load completes. A swapped request that ends
  before its swap-in frees its host slot, after its store completes if it is in flight.
Each copy is emitted as a plain record (`TierCopy` of kind "state_store" / "state_load")
and run by a `CopyLedger` of host slots (kv/copy_ledger.py: the one executor of copy
records, on every rank: the submit, the writing map a load waits on, rule 3a of
kv/copy_rules.py, and the queue whose completions release the slots, rule 5); they
complete in `poll()` / `drain()`, which TieredKVManager's poll and drain call.

Checkpoints (state_checkpoints.py) use the same host slots through `checkpoint_out` (a
copy of a slot its request keeps using: the step after it waits on the handle's gate,
the slot read into device staging, before its forward writes the slot, and a swap-out
store of that slot waits for the whole copy on the copy stream) and `checkpoint_in` (a
checkpoint into a request's new slot; the host slot stays the checkpoint's and is not
reused before the load completes).

load_scatter="compute" keeps every kernel off the copy streams: a load's scatter is
deferred to the submitting stream, and a store's or a checkpoint's gather runs there at
submission (its gate marked as its copy starts), the copy only carrying staging to host.
"""

from __future__ import annotations

from collections.abc import Callable

from batchgen.config_groups import check_choice
from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.copy_ledger import CopyLedger, TierCopy
from batchgen.kv.state_pool import HostStatePool, StatePool, StateSlots
from batchgen.kv.tier_metrics import TierMetrics


class StateTier:
    def __init__(
        self,
        device_pool: StatePool,
        host_pool: HostStatePool,
        slots: StateSlots,
        copies: CopyEngine,
        metrics: TierMetrics,
        debug: bool = False,
        load_scatter: str = "copy",
        mirror: Callable[[TierCopy], None] | None = None,
    ) -> None:
        """`mirror` (tensor parallel): called with each copy submitted, as plain data for
        the workers' mirrors (the append of the page tier's `mirrored` log); None on one
        rank."""
        check_choice("tier_load_scatter", load_scatter)
        # TieredKVManager.load_scatter: "compute" defers a load's scatter into the slots
        # to the stream that submitted it (the first wait for the load queues it)
        self.load_scatter = load_scatter
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.slots = slots
        self.copies = copies
        self.metrics = metrics  # the page tier's: one report for the whole host tier
        self.debug = debug
        self._free = list(range(host_pool.num_slots - 1, -1, -1))
        self._owned: dict[str, int] = {}  # swapped request -> its host slot
        # host slots: stores in flight writing them, copies to complete in order
        self.ledger = CopyLedger(
            copies, metrics, self._free.extend, defers=True, checks=metrics if debug else None
        )
        self._read: dict[int, CopyHandle] = {}  # device slot -> checkpoint copy reading it
        self._loading: dict[int, int] = {}  # host slot -> checkpoint loads reading it
        self.mirror = mirror

    def _emit(self, kind: str, dev_slot: int, host_slot: int, tag: str) -> TierCopy:
        """A copy this tier decided: logged for the workers' mirrors (tensor parallel),
        then run by the ledger here."""
        copy = TierCopy(kind, [dev_slot], [host_slot], [tag])
        if self.mirror is not None:
            self.mirror(copy)
        return copy

    def _pools(self) -> tuple[StatePool, HostStatePool]:
        return self.device_pool, self.host_pool

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
        dev_slot, host_slot = self.slots.detach(request_id), self._free.pop()
        copy = self._emit("state_store", dev_slot, host_slot, tag)
        readers = [self._read[dev_slot]] if dev_slot in self._read else []
        self.ledger.store(
            copy,
            self._pools(),
            ["state_swap_out"],
            lambda h: self.slots.give_back(dev_slot),
            gather=self.load_scatter == "compute",
            readers=readers,  # a checkpoint reading the slot: given back after both
        )
        self._owned[request_id] = host_slot
        self.metrics.state_swaps_out += 1
        self.metrics.count("state_swap_out", self.slot_bytes)

    def load(self, request_id: str) -> CopyHandle:
        """Swap-in: take a device slot for the request (the caller checks that one is
        free) and load its host slot into it; the step resuming the request waits on
        the handle. The host slot is held until the load completes."""
        host_slot = self._owned.pop(request_id)
        dev_slot = self.slots.take(request_id)
        copy = self._emit("state_load", dev_slot, host_slot, f"request {request_id}")
        handle = self.ledger.load(
            copy,
            self._pools(),
            ["state_swap_in"],
            lambda h: self._free.append(host_slot),
            defer=self.load_scatter == "compute",
        )
        self.metrics.state_swaps_in += 1
        self.metrics.count("state_swap_in", self.slot_bytes)
        return handle

    # ---- checkpoints (state_checkpoints.py) ---------------------------------------------
    def take_host_slot(self) -> int:
        """A free host slot for a checkpoint (the caller checks `host_room`)."""
        return self._free.pop()

    def free_host_slot(self, host_slot: int) -> bool:
        """Give a checkpoint's host slot back; False (kept) while a load reads it."""
        if self._loading.get(host_slot):
            return False
        self.ledger.release(host_slot)
        return True

    def checkpoint_out(self, dev_slot: int, host_slot: int, tag: str) -> CopyHandle:
        """Copy a slot its request keeps using to `host_slot`, ordered after the compute
        that wrote it. The handle's one gate is marked once the slot is read into staging:
        the step that runs next waits on that gate before writing the slot (a device
        gather), not on the transfer to host behind it."""
        handle = self.ledger.store(
            self._emit("state_store", dev_slot, host_slot, tag),
            self._pools(),
            ["state_checkpoint"],
            lambda h: self._read_done(h, dev_slot),
            gather=self.load_scatter == "compute",
            read_gate=True,
        )
        self._read[dev_slot] = handle
        self.metrics.count("state_checkpoint", self.slot_bytes)
        return handle

    def checkpoint_in(self, host_slot: int, dev_slot: int) -> CopyHandle:
        """Load a checkpoint into a request's new device slot; the step that resumes the
        request from it waits on the handle."""
        handle = self.ledger.load(
            self._emit("state_load", dev_slot, host_slot, f"checkpoint {host_slot}"),
            self._pools(),
            ["state_checkpoint_load"],
            lambda h: self._checkpoint_read(host_slot),
            defer=self.load_scatter == "compute",
        )
        self._loading[host_slot] = self._loading.get(host_slot, 0) + 1
        self.metrics.count("state_checkpoint_load", self.slot_bytes)
        return handle

    def forget(self, request_id: str) -> None:
        """A swapped request ended before its swap-in: its host slot is free (once its
        store completes)."""
        slot = self._owned.pop(request_id, None)
        if slot is not None:
            self.ledger.release(slot)

    # ---- completion (CopyLedger.poll / drain) -------------------------------------------
    def poll(self) -> None:
        """Complete every copy that has finished, in submission order; a deferred load
        scatter a failed step left is queued first."""
        self.ledger.poll()

    def drain(self) -> None:
        self.ledger.drain()

    @property
    def num_in_flight(self) -> int:
        return self.ledger.num_in_flight

    def _read_done(self, handle: CopyHandle, dev_slot: int) -> None:
        """A checkpoint's copy completed: a swap-out store of its slot need not wait."""
        if self._read.get(dev_slot) is handle:
            del self._read[dev_slot]

    def _checkpoint_read(self, host_slot: int) -> None:
        """A checkpoint load completed: its host slot may be given back."""
        self._loading[host_slot] -= 1
        if not self._loading[host_slot]:
            del self._loading[host_slot]
