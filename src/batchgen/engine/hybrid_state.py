"""The scheduler's part for a model with linear-attention layers: each running request
holds a compressed-state slot beside its pages, and the state cannot be rebuilt from
pages.

    admission  needs a free slot; a prefix hit is used only with `checkpoints` (the
               host tier on: a hit needs the recurrent state at its last token), cut
               back to its longest state checkpoint, whose load into the new slot the
               step waits on
    prefill    chunks end at checkpoint positions not stored yet, and the next step
               stores them first (before anything can preempt the request)
    preempt    `exact_swap` (the host tier on, with room for the pages and a slot) swaps
               pages and state whole; the request resumes at its exact position once a
               slot is free again. Otherwise the scheduler recomputes it from token 0
    replay     (deterministic mode, which swaps whenever the host has room: ExactSwap's
               `always`) a recomputed request computes its prompt in pieces as before,
               then its decoded tokens one a step, so that each takes the kernel it first
               took (on CUDA a one-token row takes the recurrent step, a piece of several
               the chunked kernel, and their bits differ); checkpoints then stay within
               prompts (a state stored past a prompt came from one-token steps)
"""

from __future__ import annotations

from batchgen.engine.request import Request
from batchgen.kv.copy_engine import CopyHandle
from batchgen.kv.exact_swap import ExactSwap
from batchgen.kv.kv_manager import KVCacheManager, PrefixHit
from batchgen.kv.state_checkpoints import StateCheckpoints
from batchgen.kv.state_pool import StateSlots


class HybridState:
    def __init__(
        self,
        kv: KVCacheManager,
        slots: StateSlots,
        exact_swap: ExactSwap | None = None,
        checkpoints: StateCheckpoints | None = None,
        replay: bool = False,
    ) -> None:
        self.kv = kv
        self.slots = slots
        self.exact_swap = exact_swap
        self.checkpoints = checkpoints
        self.replay = replay  # decoded tokens are recomputed one a step

    def track(self, req: Request) -> None:
        """A request the engine now holds: its checkpoint positions count as shared."""
        cps = self.checkpoints
        if cps is not None and cps.shared_only:
            ids = req.token_ids  # its positions may be shared with others'
            cps.track(req.request_id, self.kv.page_hashes(req.request_id, ids), len(ids))

    def swap_out(self, req: Request) -> bool:
        """Swap the request's pages and slot to host; False: it must be recomputed (a
        slot's state cannot be rebuilt from pages, so all of it moves or none)."""
        swap = self.exact_swap
        return swap is not None and swap.swap_out(req.request_id, req.num_computed_tokens)

    def holds(self, request_id: str) -> bool:
        """The request is swapped whole: it resumes at its exact position."""
        return self.exact_swap is not None and self.exact_swap.holds(request_id)

    def prefix_hit(self, req: Request) -> PrefixHit:
        """The request's prefix hit, cut back to its longest prefix with a state
        checkpoint at its end (none without checkpoints)."""
        if self.checkpoints is None:
            return PrefixHit()
        hits = self.kv.lookup_prefix(req.request_id, req.token_ids)
        total = len(hits) + len(hits.host_pages)
        if not total:
            return hits
        if self.replay:  # a checkpoint past the prompt holds another request's prefill
            total = min(total, req.num_prompt_tokens // self.kv.page_size)
        hashes = self.kv.page_hashes(req.request_id, req.token_ids)
        pages = self.checkpoints.longest(hashes, total)
        return PrefixHit(hits[:pages], hits.host_pages[: max(0, pages - len(hits))])

    def admit(self, req: Request, cached: int, exact: bool) -> list[CopyHandle]:
        """The admitted request takes a slot: its swapped state loads back into it
        (`exact`), or the state of its prefix hit of `cached` tokens does (the copy
        returned for the step to wait on; the swap's come with `take_swap_waits`)."""
        if exact:
            self.exact_swap.swap_in(req.request_id)  # takes a slot, loads pages and state
            return []
        slot = self.slots.take(req.request_id)
        if not cached:
            return []
        hashes = self.kv.page_hashes(req.request_id, req.token_ids)
        page = cached // self.kv.page_size
        return [self.checkpoints.load(hashes[page - 1], slot, cached)]

    def cut(self, req: Request, computed: int, n: int) -> int:
        """n tokens from `computed`, cut to end at a checkpoint position not yet stored;
        with `replay`, at the prompt's end, and one token past it."""
        if self.replay:
            prompt = req.num_prompt_tokens
            n = 1 if computed >= prompt else min(n, prompt - computed)
        if self.checkpoints is None or n <= 1:
            return n
        hashes = self.kv.page_hashes(req.request_id, req.token_ids)
        return self.checkpoints.cut(computed, n, req.num_tokens, hashes)

    def take_checkpoints(self, running: list[Request]) -> list[CopyHandle]:
        """Store the state of running requests that stopped at a checkpoint position
        (the copies the step waits on)."""
        waits, cps = [], self.checkpoints
        if cps is None:
            return waits
        for req in running:
            computed = req.num_computed_tokens
            if not computed or computed % cps.interval or computed >= req.num_tokens - 1:
                continue  # not at a position, or decoding (a step may be queued)
            if self.replay and computed > req.num_prompt_tokens:
                continue  # replaying decoded tokens: their state is not a prefill's
            hashes = self.kv.page_hashes(req.request_id, req.token_ids)
            slot = self.slots.slot(req.request_id)
            handle = cps.take(slot, computed, hashes, f"request {req.request_id}")
            if handle is not None:
                waits.append(handle)
        return waits

    def take_swap_waits(self) -> list[CopyHandle]:
        """The state loads of the step's swap-ins, for its forward to wait on."""
        return [] if self.exact_swap is None else self.exact_swap.take_waits()

    def release(self, request_id: str) -> None:
        """The request left the running set: its slot is free."""
        self.slots.release(request_id)

    def ended(self, request_id: str, swapped: bool) -> None:
        """The request ended (finished or aborted); `swapped`: it may wait on host, whose
        pages and slot are freed."""
        if swapped and self.exact_swap is not None:
            self.exact_swap.forget(request_id)
        if self.checkpoints is not None:
            self.checkpoints.untrack(request_id)
