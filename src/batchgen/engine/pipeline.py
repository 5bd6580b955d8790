"""Pipelined decode: the next decode step, built before the queued one's tokens are known.

    host:  build N+1 | launch N+1 | wait N's tokens | update N | build N+2 | launch ...
    GPU:   ....... step N ........|........... step N+1 ..........|.... step N+2
           (N+1 reads N's sampled tokens on the device)

A request whose token from step N is its last by length is left out of N+1; one that
stops on a token nobody could foresee (EOS, a stop string) computes one token too many
in N+1, which the update discards (its pages are freed after N+1 was queued, so any
reuse comes later in stream order).

Nothing here preempts: a swap (pages and, for hybrid models, the state slot) is decided
only by schedule(), which runs with no step queued, so the state and pages it copies are
those of every token the request computed; the copy's producer event, recorded then on
the compute stream, orders it after every step launched before.
"""

from __future__ import annotations

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.runner.batch import BlindEntries, SchedulerOutput, StepCopies, row_fields


def could_admit(scheduler: Scheduler, kv: KVCacheManager) -> bool:
    """The waiting request schedule() would admit first has a free seat and the pages
    for its prompt (a request deferred by prefix admission is not asked about)."""
    if not scheduler.waiting or len(scheduler.running) >= scheduler.max_num_seqs:
        return False
    if not kv.num_free_pages:  # every admission takes a page: skip the ordering
        return False
    candidate = scheduler.admission_candidate()
    return candidate is not None and kv.num_free_pages >= candidate[1]


def ending_by_length(
    queued: SchedulerOutput, scheduler: Scheduler, requests: dict[str, Request]
) -> list[Request]:
    """The requests of `queued` whose token from it is their last by length (asked only
    where next_decode gave up and a request waits: a few dozen steps a run)."""
    running, reaches_length = RequestStatus.RUNNING, scheduler.reaches_length
    out = []
    for rid, _, sample, _ in row_fields(queued.requests):
        req = requests.get(rid)
        if req is not None and req.status is running and sample and reaches_length(req, 1):
            out.append(req)
    return out


def seats_wait(queued: SchedulerOutput, scheduler: Scheduler) -> bool:
    """`queued` admitted requests and every seat free now was freed after its schedule
    (stops that no schedule could foresee: EOS, stop ids, stop strings): those seats wait
    for the step after the next, so admitting steps, whose forward cannot replay a decode
    graph, come at most every other step, each taking two steps' stops."""
    free = scheduler.max_num_seqs - len(scheduler.running)
    if free > scheduler.num_left_since_schedule:
        return False
    entries = queued.requests
    if isinstance(entries, BlindEntries):  # a new request's entry is among the general
        entries = entries.general.values()
    return any(s.new is not None for s in entries)


def next_decode(
    queued: SchedulerOutput,
    scheduler: Scheduler,
    kv: KVCacheManager,
    requests: dict[str, Request],
    admit: bool = True,
) -> tuple[SchedulerOutput, StepCopies] | None:
    """The decode step after `queued` (a step whose tokens are not known yet: a decode
    step, or one whose prompt rows end their prompts) and its copies, or None when it
    cannot be built blind: a waiting request could be admitted now (only asked with
    `admit`) or once a request ends by length with `queued`, a prompt has chunks left,
    or pages run short. Its requests' input tokens are placeholders (-1): the runner
    reads the tokens `queued` samples on the device."""
    if admit and could_admit(scheduler, kv):
        return None
    reqs, starts = [], []
    allocate, finished = kv.allocate, RequestStatus.FINISHED
    max_model_len, held, page_size = scheduler.max_model_len, kv.pages.get, kv.page_size
    entries = queued.requests
    queued_reqs = scheduler.feed.requests_of(queued)  # as its entries were made
    if queued_reqs is None:
        queued_reqs = [requests.get(s.request_id) for s in entries]
    for (_, n, sample, start), req in zip(row_fields(entries), queued_reqs):
        if req is None or req.status is finished:  # a request that left is finished
            continue
        if not sample:  # a prompt chunk: schedule() cuts its next one
            return None
        # scheduler.reaches_length(req, ahead=1), inline: its token from `queued` is its last
        if (
            len(req.output_token_ids) + 1 >= req.max_tokens
            or len(req.token_ids) + 1 >= max_model_len
        ):
            if scheduler.waiting:  # its seat goes to a waiting request: schedule() admits
                return None
            continue
        start += n  # a decode row's start + 1, a prompt's last chunk's end
        pages = held(req.request_id)  # allocate's first check, inline: most rows' pages cover it
        if (pages is None or len(pages) * page_size <= start) and not allocate(
            req.request_id, start + 1
        ):
            return None
        reqs.append(req)
        starts.append(start)
    if not reqs:
        return None
    entries = scheduler.feed.blind_entries(reqs, starts)
    # new pages may have evicted cached ones the tier writes back first
    step = SchedulerOutput(entries, released_ids=scheduler.take_released(), blind=True)
    return step, StepCopies(kv.take_step_copies())
