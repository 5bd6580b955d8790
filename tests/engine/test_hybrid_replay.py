"""deterministic mode's hybrid preemption, driven with fabricated runner outputs: a
recomputed request computes its prompt, then replays its decoded tokens one a step (the
one-token rows take on CUDA the recurrent KDA step they first took), and ExactSwap swaps
even where the tier's cost rule says recompute."""

from __future__ import annotations

from test_scheduler_state_slots import PS, add, make_swapping, step, step_until_preempted

from batchgen.engine.request import RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.state_pool import StateSlots


def recompute_pieces(chunk_align: int) -> tuple[int, list[tuple[int, int, bool]]]:
    """b's prompt length and its (start, tokens, sampled) pieces after it was recomputed."""
    kv = KVCacheManager(PageAllocator(5, True), PS)
    slots = StateSlots(2)
    sched = Scheduler(kv, 2, 64, 1000, [2], state_slots=slots, chunk_align=chunk_align)
    requests = {}
    a = add(sched, requests, "a", 4, max_tokens=8)
    b = add(sched, requests, "b", 6, max_tokens=8, base=2000)
    out = step_until_preempted(sched, requests, slots)
    assert out.preempted_ids == ["b"] and sched.num_recomputes == 1
    assert b.status == RequestStatus.WAITING and b.output_token_ids
    pieces = []
    while not b.is_finished:
        for s in step(sched, requests, slots).requests:
            if s.request_id == "b":
                pieces.append((s.start, len(s.new_token_ids), s.sample))
    assert a.is_finished
    return b.num_prompt_tokens, pieces


def test_a_recompute_replays_decoded_tokens_one_a_step():
    prompt, pieces = recompute_pieces(chunk_align=PS)  # deterministic, hybrid
    first, *rest = pieces
    assert first == (0, prompt, False)  # the prompt alone, in one piece: no sample
    assert all(n == 1 for _, n, _ in rest)
    assert [start for start, _, _ in rest] == list(range(prompt, prompt + len(rest)))
    assert not all(sample for _, _, sample in rest)  # replayed rows, then new tokens
    # outside deterministic mode the prompt and decoded tokens go in one piece
    _, pieces = recompute_pieces(chunk_align=1)
    assert pieces[0][0] == 0 and pieces[0][1] > prompt and pieces[0][2]


def test_always_swaps_where_the_cost_rule_says_recompute():
    for always in (False, True):
        sched, slots, tier = make_swapping()
        tier.loads_pay = False  # the cost rule's verdict: recompute
        sched.exact_swap.always = always
        requests = {}
        add(sched, requests, "a", 4, max_tokens=12)
        b = add(sched, requests, "b", 6, max_tokens=12, base=2000)
        step_until_preempted(sched, requests, slots)
        swapped = RequestStatus.SWAPPED if always else RequestStatus.WAITING
        assert b.status == swapped
        assert (tier.metrics.swaps_out, sched.num_recomputes) == ((1, 0) if always else (0, 1))
