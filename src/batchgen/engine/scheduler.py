"""The scheduler: which requests compute how many tokens this step. Never touches tensors."""

from __future__ import annotations

from collections import deque

from batchgen.config_groups import check_choice
from batchgen.engine.hybrid_state import HybridState
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.runner_feed import RunnerFeed
from batchgen.engine.step_update import StepUpdates
from batchgen.engine.waiting import ArrivalWaiting, PrefixWaiting
from batchgen.kv.exact_swap import ExactSwap
from batchgen.kv.kv_manager import KVCacheManager, PrefixHit
from batchgen.kv.state_checkpoints import StateCheckpoints
from batchgen.kv.state_pool import StateSlots
from batchgen.runner.batch import (
    SchedulerOutput,
    StepCopies,
)


class Scheduler(StepUpdates):
    """Continuous batching under a per-step token budget.

    Each step: running requests first, in admission order (a prefill chunk or one
    decode token each); when pages run out, the newest running request is preempted
    (its pages are dropped and it is recomputed later, from the prefix cache where
    its pages survive). Then, if nothing was preempted, waiting requests are admitted
    while pages, the token budget and max_num_seqs allow; the first that does not fit
    ends admission for the step.

    With `state_slots` (a model with linear-attention layers) each running request also
    holds a compressed-state slot, and `exact_swap` and `checkpoints` may come with them:
    hybrid_state.py says what they change.

    admission="arrival" admits in arrival order (preempted requests first);
    admission="prefix" admits preempted requests first, then by cached prefix length,
    deferring a request whose next uncached page a running request is computing
    (`PrefixWaiting`).

    A step's results (update, commit, apply) are step_update.py's `StepUpdates`.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        admission: str = "prefix",
        state_slots: StateSlots | None = None,
        exact_swap: ExactSwap | None = None,
        checkpoints: StateCheckpoints | None = None,
        defer_stores_ahead: bool = False,
        chunk_align: int = 1,
    ) -> None:
        check_choice("admission", admission)
        if state_slots is None and (exact_swap is not None or checkpoints is not None):
            raise ValueError("exact_swap and checkpoints need state_slots")
        self.kv = kv
        self.state_slots = state_slots
        self.exact_swap = exact_swap
        self.checkpoints = checkpoints
        self.hybrid = None  # a model with linear-attention layers: each request's state
        if state_slots is not None:
            self.hybrid = HybridState(kv, state_slots, exact_swap, checkpoints, chunk_align > 1)
        self.admission = admission
        self.chunk_align = chunk_align  # a cut-short prefill ends at a multiple of it
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        # every request's stop_token_ids added so far (never shrinks): the update's check
        # of a row's token against the stop sets is one lookup in eos | this
        self.stop_token_union: set[int] = set()
        # the engine launches the forward before the step's stores ahead are submitted
        # (KVCacheManager.take_step_copies); it calls kv.flush_ahead() then
        self.defer_stores_ahead = defer_stores_ahead
        self.waiting: ArrivalWaiting | PrefixWaiting = (
            ArrivalWaiting() if admission == "arrival" else PrefixWaiting()
        )
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputes = 0
        self.num_computed_tokens_total = 0
        self.num_prompt_tokens_computed = 0  # prompt positions computed, recomputes included
        self.num_left_since_schedule = 0  # seats freed since schedule() last ran
        self._retired: set[str] = set()  # out of the running set, last token in flight
        # what the runner has been told: each step carries only what changed
        self.feed = RunnerFeed(kv, state_slots)
        # steps committed and not applied yet, oldest first, with what each counted
        self._committed: deque[tuple[SchedulerOutput, dict[str, int]]] = deque()

    def add(self, request: Request) -> None:
        if request.stop_token_ids:
            self.stop_token_union |= request.stop_token_ids
        if self.hybrid is not None:
            self.hybrid.track(request)
        ids, hashes = request.token_ids, []  # no hashes: nothing is cached, arrival order
        if self.admission == "prefix" and self.kv.allocator.enable_caching:
            hashes = self.kv.page_hashes(request.request_id, ids)
            hashes = hashes[: (len(ids) - 1) // self.kv.page_size]
        self.waiting.add(request, hashes)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, request: Request) -> None:
        """Swap the request's KV (and state slot) to host if the tier has room, else drop
        it (recompute)."""
        if self.hybrid is None:
            swapped = self.kv.swap_out(request.request_id, request.num_computed_tokens)
        else:
            swapped = self.hybrid.swap_out(request)
        if swapped:
            request.status = RequestStatus.SWAPPED
        else:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.num_recomputes += 1
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._left_running(request)
        self.waiting.appendleft(request)

    def unsend(self, step: SchedulerOutput) -> None:
        """A step built and never run: RunnerFeed.unsend."""
        self.feed.unsend(step)

    def take_copies(self) -> StepCopies:
        """This process's copy handles and per-layer store hook for the step schedule()
        built last (the engine hands them to the runner beside the step)."""
        return self.feed.take_copies()

    def take_released(self) -> list[str]:
        """Ids that left the running set since the last call; each step hands them to
        the runner (schedule() does, and so does a pipelined step built outside it)."""
        return self.feed.take_released()

    def schedule(self) -> SchedulerOutput:
        preempted: list[str] = []
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # before anything can preempt a request: its state at a checkpoint position is
        # copied first, and this step's forward waits for the copy before writing it
        waits = [] if self.hybrid is None else self.hybrid.take_checkpoints(self.running)
        i = 0
        running, allocate, plain = self.running, self.kv.allocate, self.hybrid is None
        max_model_len, held, page_size = self.max_model_len, self.kv.pages.get, self.kv.page_size
        is_running = RequestStatus.RUNNING
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_pending
            if pending and (  # reaches_length(req, ahead=pending), inline: ~900 rows
                len(req.output_token_ids) + pending >= req.max_tokens
                or len(req.token_ids) + pending >= max_model_len
            ):
                i += 1  # its token in flight is its last: it finishes when applied
                continue
            n = len(req.token_ids) + req.num_pending - req.num_computed_tokens
            if n > budget or not plain:  # else all it has left, as _chunk says
                n = self._chunk(req, req.num_computed_tokens, budget)
            if n == 0:  # the budget left does not reach its next aligned end
                i += 1
                continue
            pages = held(req.request_id)  # allocate's first check, inline: most rows' pages
            if pages is None or len(pages) * page_size < req.num_computed_tokens + n:  # cover
                while not allocate(req.request_id, req.num_computed_tokens + n):
                    victim = self.running.pop()
                    self.preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
            if req.status is not is_running:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1
        candidates = iter(()) if preempted else self.waiting.candidates(self.kv)
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = next(candidates, None)
            if req is None:
                break
            # a swapped request comes back like any other: its full pages from the device
            # prefix cache or the host, its last partial page recomputed
            if self.hybrid is not None and not self.state_slots.num_free:
                break
            exact = self.hybrid is not None and self.hybrid.holds(req.request_id)
            if req.prompt_logprobs_due or exact:  # every prompt position must be computed
                hits = PrefixHit()
            elif self.hybrid is not None:
                hits = self.hybrid.prefix_hit(req)
            else:
                hits = self.kv.lookup_prefix(req.request_id, req.token_ids)
            cached = req.num_computed_tokens if exact else self.kv.hit_tokens(hits)
            n = self._chunk(req, cached, budget)
            if n == 0 or not self.kv.allocate(req.request_id, cached + n, hits):
                break
            if req.num_preemptions == 0:
                self.kv.note_admission(req.num_tokens)
            if self.hybrid is not None:
                waits += self.hybrid.admit(req, cached, exact)
            req.num_computed_tokens = cached
            req.status = RequestStatus.RUNNING
            self._admitted(req)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        hook = self.kv.layer_store_hook(  # read only where a layer hook can be wanted
            (r.request_id, r.num_computed_tokens, r.token_ids) for r, n in scheduled if n == 1
        )
        waits = self.kv.take_step_copies(self.defer_stores_ahead) + waits
        if self.hybrid is not None:
            waits += self.hybrid.take_swap_waits()
        self.feed.set_copies(StepCopies(waits, hook))
        entries = self.feed.entries(scheduled)
        self.num_left_since_schedule = 0  # a seat free now was seen by this schedule
        return SchedulerOutput(entries, preempted, self.take_released())

    def _chunk(self, req: Request, computed: int, budget: int) -> int:
        """Tokens the request computes this step from `computed`: what is left, within
        the budget (cut short: ending at a multiple of chunk_align, maybe 0 tokens),
        ending at a state checkpoint position not yet stored."""
        left = req.num_tokens + req.num_pending - computed
        n = min(left, budget)
        if n < left:
            n -= (computed + n) % self.chunk_align
        if self.hybrid is None or n <= 1:
            return n
        return self.hybrid.cut(req, computed, n)

    def _admitted(self, req: Request) -> None:
        """Out of `waiting`; under prefix admission it claims the pages it computes
        (those after its prefix hit, device or host)."""
        self.waiting.take(req)
        if self.admission == "prefix" and self.kv.allocator.enable_caching:
            hashes = self.kv.page_hashes(req.request_id, req.token_ids)
            start = req.num_computed_tokens // self.kv.page_size
            self.waiting.claim(req.request_id, hashes[start:])

    def retire(self, req: Request) -> None:
        """The request's token in flight (a queued step's, not applied yet) is its last
        by length: it leaves the running set now, so a step scheduled while that token is
        on its way gives its seat to a waiting request, as one scheduled after it would.
        Its pages stay until the token is applied and ends it (`finish`)."""
        self.running.remove(req)
        self._left_running(req)
        self._retired.add(req.request_id)

    def _left_running(self, req: Request) -> None:
        if req.request_id in self._retired:  # it left already: its end changes nothing
            self._retired.discard(req.request_id)
            return
        self.num_left_since_schedule += 1
        self.feed.left(req.request_id)
        if self.hybrid is not None:
            self.hybrid.release(req.request_id)
        self.waiting.release(req.request_id)

    def admission_candidate(self) -> tuple[Request, int] | None:
        """The request schedule() would try to admit first and the free device pages its
        whole prompt would take (prefix admission counts the cached pages running
        requests hold as free); None when nothing waits, all waiting are deferred or no
        state slot is free."""
        if self.hybrid is not None and not self.state_slots.num_free:
            return None
        req = next(self.waiting.candidates(self.kv), None)
        return None if req is None else (req, self.waiting.pages_to_admit(req, self.kv))

    def reaches_length(self, req: Request, ahead: int = 0) -> bool:
        """The request is at its length limit (max_tokens or max_model_len) once it has
        `ahead` more tokens."""
        return (
            len(req.output_token_ids) + ahead >= req.max_tokens
            or len(req.token_ids) + ahead >= self.max_model_len
        )

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is, releasing its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        self.kv.forget(req.request_id)
        if self.hybrid is not None:
            self.hybrid.ended(req.request_id, swapped=True)
        self._left_running(req)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End the request and release its pages. A request already ended by length can
        still be given a stop (a stop string its last token completed wins, as in vLLM
        and OpenAI); any other finished request keeps its reason."""
        if req.is_finished:
            if req.finish_reason == "length" and reason == "stop":
                req.finish_reason, req.stop_reason = reason, stop_reason
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        swapped = False  # preempted while its last token was in flight
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            swapped = True
        if self.hybrid is not None:
            self.hybrid.ended(req.request_id, swapped)
        self.kv.forget(req.request_id)
        self._left_running(req)
