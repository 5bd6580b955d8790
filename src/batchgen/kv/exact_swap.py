"""ExactSwap: swap of requests whose compressed state cannot be rebuilt from pages
(models with linear-attention layers). Every page of the request, its last partial one
too, and its state slot go to host, and the request resumes where it stopped.

kv_manager.py's swap (full pages stay in the device prefix cache, written back to host
only if evicted; the last partial page recomputed) does not fit these requests: prefix
caching is off for them (a hit would need the recurrent state at the hit's end; state
checkpoints are a later step), and recomputing a partial page would run its tokens
through the recurrence twice.

    preempt  swap_out: pages -> tier.queue_swap_out (freed at once; the flush reads
             them on the compute stream, as for a write-back); slot -> states.store
             (the device slot is free only once that copy completes)
    resume   swap_in (after kv.allocate covered the request's tokens and a slot is
             free): host pages -> its first device pages with the step's load; host
             slot -> a new device slot; the step waits on both (take_waits -> wait_for)

A swap needs host room for both the pages and a slot (a state checkpoint gives its slot
up for it); otherwise the caller recomputes. `always` (deterministic mode) swaps whatever
the tier's cost rule says: a recompute runs the request's decoded tokens again, one at a
time (engine/hybrid_state.py), which costs more than the cost rule's prefill rate.
"""

from __future__ import annotations

from batchgen.kv.copy_engine import CopyHandle
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.state_checkpoints import StateCheckpoints
from batchgen.kv.state_tier import StateTier


class ExactSwap:
    def __init__(
        self,
        kv: KVCacheManager,
        states: StateTier,
        checkpoints: StateCheckpoints | None = None,
        always: bool = False,
    ) -> None:
        if kv.tier is None:
            raise ValueError("ExactSwap needs the page tier attached to the KV manager")
        self.kv = kv
        self.tier = kv.tier
        self.states = states
        self.checkpoints = checkpoints  # give up a host slot to a swap that needs one
        self.always = always  # swap even where the cost rule says recompute
        self._host_pages: dict[str, list[int]] = {}  # swapped request -> its host pages
        self._waits: list[CopyHandle] = []  # state loads of the step being planned

    def holds(self, request_id: str) -> bool:
        """The request is swapped: its pages and state wait on host."""
        return request_id in self._host_pages

    def swap_out(self, request_id: str, num_computed: int) -> bool:
        """Move the request's pages and state slot to host, releasing its device pages;
        False (nothing changed) when the tier is idle (the cost rule says recompute, and
        not `always`), nothing is computed yet, or the host has no room for either."""
        pages = self.kv.pages.get(request_id, [])[: self.kv.pages_needed(num_computed)]
        if not (self.tier.loads_pay or self.always) or not pages:
            return False
        if len(pages) > self.tier.host_room():
            return False
        if not self.states.host_room and self.checkpoints is not None:
            self.checkpoints.make_room()
        if not self.states.host_room:
            return False
        tag = f"request {request_id}"
        self._host_pages[request_id] = self.tier.queue_swap_out(pages, tag)
        self.states.store(request_id, tag)
        self.kv.free(request_id)
        self.tier.metrics.swaps_out += 1
        return True

    def swap_in(self, request_id: str) -> None:
        """Load a swapped request back: its pages into the first of the device pages
        kv.allocate gave it (the caller allocated them), its state into a new slot (the
        caller checked one is free)."""
        host = self._host_pages.pop(request_id)
        dev = self.kv.pages[request_id][: len(host)]
        self.tier.queue_load(host, dev, "swap_in", f"request {request_id}")
        self.tier.release_host(host)  # the load holds them until it completes
        self._waits.append(self.states.load(request_id))
        self.tier.metrics.swaps_in += 1

    def forget(self, request_id: str) -> None:
        """The request ended (aborted) while swapped: its host pages and slot are free."""
        host = self._host_pages.pop(request_id, None)
        if host is not None:
            self.tier.release_host(host)
        self.states.forget(request_id)

    def take_waits(self) -> list[CopyHandle]:
        """The state loads the step's forward must wait on (its page loads come with
        kv.take_step_copies())."""
        out, self._waits = self._waits, []
        return out
