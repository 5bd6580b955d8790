"""RunnerFeed (engine/runner_feed.py): what each step tells the runner of a request."""

from __future__ import annotations

from batchgen.engine.request import Request
from batchgen.engine.runner_feed import RunnerFeed
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.page_allocator import PageAllocator
from batchgen.runner.batch import SchedulerOutput
from batchgen.sampling_params import SamplingParams

PS = 4


def _feed_and_requests() -> tuple[RunnerFeed, list[tuple[Request, int]]]:
    """A feed that sent "held" and "grows" their pages at 6 tokens, and never "fresh";
    then "grows" got a page for its 9th token."""
    kv = KVCacheManager(PageAllocator(32, True), PS)
    feed = RunnerFeed(kv)
    reqs = {rid: Request(rid, list(range(6)), SamplingParams(), 50) for rid in ("held", "grows")}
    for rid, req in reqs.items():
        assert kv.allocate(rid, 6)
        feed.entry(req, list(range(6)), 0, True)
        req.output_token_ids += [7, 8]
        req.token_ids += [7, 8]
    assert kv.allocate("grows", 9)
    fresh = Request("fresh", [1, 2, 3], SamplingParams(), 50)
    assert kv.allocate("fresh", 4)
    following = [(reqs["held"], 7), (fresh, 3), (reqs["grows"], 8)]
    return feed, following


def test_blind_entries_are_the_entries_entry_makes():
    """A blind decode step's entries in one call: each as `entry(req, [-1], start, True)`
    makes it (new pages, a new request's fixed data), and the feed records the same."""
    feed, following = _feed_and_requests()
    got = feed.blind_entries([req for req, _ in following], [start for _, start in following])
    feed_one, following_one = _feed_and_requests()
    want = [feed_one.entry(req, [-1], start, True) for req, start in following_one]
    assert got == want
    assert [list(e.new_pages) for e in got] == [[], [want[1].new_pages[0]], [want[2].new_pages[0]]]
    assert [e.new is not None for e in got] == [False, True, False]
    assert [e.num_output_tokens for e in got] == [2, 0, 2]
    assert feed._sent == feed_one._sent


def test_entries_are_those_schedule_made_one_by_one():
    """A scheduled step's entries in one call: each as `entry` makes it from the request's
    next inputs (a placeholder for a pending token) and whether they reach its end."""

    def scheduled():
        feed, following = _feed_and_requests()
        (held, _), (fresh, _), (grows, _) = following
        held.num_computed_tokens = 7  # decodes its 8th token: samples
        grows.num_computed_tokens, grows.num_pending = 8, 1  # its pending token: -1
        return feed, [(held, 1), (fresh, 2), (grows, 1)]  # fresh: 2 of 3 prompt tokens

    feed, rows = scheduled()
    got = feed.entries(rows)
    feed_one, rows_one = scheduled()
    want = []
    for req, n in rows_one:
        start = req.num_computed_tokens
        sample = start + n == len(req.token_ids) + req.num_pending
        want.append(feed_one.entry(req, req.next_inputs(n), start, sample))
    assert got == want
    assert [(e.new_token_ids, e.sample) for e in got] == [
        ([8], True),
        ([1, 2], False),
        ([-1], True),
    ]
    assert feed._sent == feed_one._sent


def test_requests_of_names_the_requests_a_step_was_made_from():
    """The entries a feed made, by step: their requests in row order, for the last two
    steps it made; None for a step it did not make (its update looks them up by id)."""
    feed, following = _feed_and_requests()
    first = SchedulerOutput(feed.blind_entries([req for req, _ in following], [7, 3, 8]))
    assert feed.requests_of(first) == [req for req, _ in following]
    assert feed.requests_of(SchedulerOutput(list(first.requests))) is None  # made elsewhere
    later = [SchedulerOutput(feed.entries([(following[0][0], 1)])) for _ in range(2)]
    assert feed.requests_of(later[-1]) == [following[0][0]]
    assert feed.requests_of(first) is None  # two steps made since
