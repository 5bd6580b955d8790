"""What the runner has been told of the running requests, so that each step carries only
what changed (runner/batch.py: the step is plain data, the runner keeps the rest).

    request admitted ----> entry: new (params, prompt, output so far, seed) + all pages
    running, next step --> entry: the pages added since its last entry (often none)
    left the running set -> its id in the next step's released_ids; its next entry is new
    step never run ------> unsend: its released ids, new requests and pages go again
"""

from __future__ import annotations

from collections import deque

from batchgen.engine.request import Request
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.state_pool import StateSlots
from batchgen.runner.batch import (
    NO_COPIES,
    PLACEHOLDER,
    BlindEntries,
    NewRequest,
    ScheduledRequest,
    SchedulerOutput,
    StepCopies,
)

_NO_PAGES: tuple[int, ...] = ()  # most decode steps add no page: no list made for them


class RunnerFeed:
    """The scheduler's record of what the runner holds: the pages of each running
    request it was sent, the ids that left the running set since the last step, and this
    process's copies for the step built last (handed beside the step, never in it)."""

    def __init__(self, kv: KVCacheManager, state_slots: StateSlots | None = None) -> None:
        self.kv = kv
        self.state_slots = state_slots
        self._sent: dict[str, int] = {}  # request id -> pages of its list sent
        self._released: list[str] = []
        self._copies = NO_COPIES
        # the last steps' entries made here, each with its requests (`requests_of`)
        self._built: deque[tuple[list[ScheduledRequest], list[Request]]] = deque(maxlen=2)

    def left(self, request_id: str) -> None:
        """The request left the running set: the runner drops it with the next step."""
        self._released.append(request_id)
        self._sent.pop(request_id, None)

    def take_released(self) -> list[str]:
        out, self._released = self._released, []
        return out

    def set_copies(self, copies: StepCopies) -> None:
        self._copies = copies

    def take_copies(self) -> StepCopies:
        copies, self._copies = self._copies, NO_COPIES
        return copies

    def requests_of(self, step: SchedulerOutput) -> list[Request] | None:
        """The request of each entry of `step`, as its entries were made here (by
        `entries` or `blind_entries`, among the last two steps made: the one queued and
        the one built after it; more would keep their objects alive for the collector to
        walk; else None): a step's update reads its rows' requests from it instead of
        looking each up by id."""
        for entries, reqs in self._built:
            if entries is step.requests:
                return reqs
        return None

    def unsend(self, step: SchedulerOutput) -> None:
        """A step built and never run (empty, or not launchable): what it told the runner
        (released ids, new requests, new pages) goes with the next step instead."""
        self._released[:0] = step.released_ids
        sent = self._sent
        for r in step.requests:
            if r.new is not None:
                sent.pop(r.request_id, None)
            elif r.request_id in sent:
                sent[r.request_id] -= len(r.new_pages)

    def entry(
        self, req: Request, new_token_ids: list[int], start: int, sample: bool
    ) -> ScheduledRequest:
        """A running request's entry in a step: its new pages since the last entry made
        for it (all of them, with its fixed data, if the runner does not hold it)."""
        rid = req.request_id
        pages = self.kv.pages[rid]
        sent = self._sent.get(rid)
        new = None
        if sent is None:  # copied: the runner keeps what it was sent, the request moves on
            new = NewRequest(req.params, req.prompt_token_ids, list(req.output_token_ids), req.seed)
            sent = 0
        self._sent[rid] = len(pages)
        return ScheduledRequest(
            rid,
            new_token_ids,
            start,
            pages[sent:] if len(pages) > sent else _NO_PAGES,
            sample,
            len(req.output_token_ids),
            None if self.state_slots is None else self.state_slots.slot(rid),
            new,
        )

    def entries(self, scheduled: list[tuple[Request, int]]) -> list[ScheduledRequest]:
        """The entries of a step whose requests compute their next n tokens from
        num_computed_tokens, for each (req, n) of `scheduled`, in one loop: `entry` as
        Scheduler.schedule() would make each (inputs `Request.next_inputs(n)`, sampling
        where they reach its last known or pending token)."""
        return self._entries(
            (req, req.next_inputs(n), req.num_computed_tokens, n) for req, n in scheduled
        )

    def blind_entries(self, reqs: list[Request], starts: list[int]) -> BlindEntries:
        """`entry(req, [-1], start, True)` for each req and start of a decode step built
        blind (pipeline.next_decode), as columns (`BlindEntries`: ~900 rows on most
        steps of a decode-heavy job, most held by the runner and given no page since
        their last entry, made without an object a row)."""
        pages_of, sent_of, slots = self.kv.pages, self._sent, self.state_slots
        ids, outputs, general = [], [], {}
        for i, req in enumerate(reqs):
            rid = req.request_id
            ids.append(rid)
            outputs.append(len(req.output_token_ids))
            sent = sent_of.get(rid)
            if sent is None or slots is not None or sent != len(pages_of[rid]):
                general[i] = self.entry(req, PLACEHOLDER, starts[i], True)  # the general case
        out = BlindEntries(ids, starts, outputs, general)
        self._built.append((out, reqs))
        return out

    def _entries(self, rows) -> list[ScheduledRequest]:
        """`entry` for each (req, new_token_ids, start, n) of `rows` (it samples where
        start + n reaches the request's last known or pending token): ~900 rows a step,
        most held by the runner already and given no page since their last entry, made
        here without a call."""
        pages_of, sent_of, slots = self.kv.pages, self._sent, self.state_slots
        out, reqs = [], []
        for req, inputs, start, n in rows:
            reqs.append(req)
            sample = start + n == len(req.token_ids) + req.num_pending
            rid = req.request_id
            pages = pages_of[rid]
            sent = sent_of.get(rid)
            if sent is None or slots is not None or sent != len(pages):  # the general case
                out.append(self.entry(req, inputs, start, sample))
                continue
            out.append(
                ScheduledRequest(rid, inputs, start, _NO_PAGES, sample, len(req.output_token_ids))
            )
        self._built.append((out, reqs))
        return out
