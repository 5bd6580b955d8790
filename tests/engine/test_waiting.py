"""Prefix admission (PrefixWaiting through the Scheduler): order by cached prefix length,
deferral behind pages a running request computes, preempted requests first, and the
pipeline's could_admit asking for the request schedule() would really admit. KV state is
fabricated with a real KVCacheManager whose pages are registered by hand."""

from __future__ import annotations

import pytest

from batchgen.engine.pipeline import could_admit
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.page_allocator import PageAllocator
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput
from batchgen.sampling_params import SamplingParams

PS = 4
EOS = 2


class Engine:
    """A scheduler over a real KVCacheManager; steps sample token 100 + n (never EOS)
    unless told otherwise."""

    def __init__(self, num_pages=64, seqs=16, budget=200, admission="prefix", caching=True):
        self.kv = KVCacheManager(PageAllocator(num_pages, caching), PS)
        self.sched = Scheduler(self.kv, seqs, budget, 1000, [EOS], admission=admission)
        self.requests: dict[str, Request] = {}
        self.computed = 0

    def add(self, rid, prompt, max_tokens=3, arrival=None, **params) -> Request:
        req = Request(
            rid,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, **params),
            max_tokens,
            arrival=len(self.requests) if arrival is None else arrival,
        )
        self.requests[rid] = req
        self.sched.add(req)
        return req

    def cache(self, tokens: list[int], hold: bool = False) -> None:
        """Register the full pages of `tokens` in the device prefix cache, as a request
        that computed them would (and freed them, unless `hold`)."""
        rid = f"warm{len(self.kv.pages)}-{tokens[0]}"
        assert self.kv.allocate(rid, len(tokens))
        self.kv.cache_computed(rid, tokens, len(tokens))
        if not hold:
            self.kv.forget(rid)

    def step(self, token=None) -> SchedulerOutput:
        out = self.sched.schedule()
        sampled = [s for s in out.requests if s.sample]
        ids = [s.request_id for s in sampled]
        pick = token or (lambda r: 100 + len(r.output_token_ids))
        toks = [pick(self.requests[i]) for i in ids]
        self.sched.update(out, ModelRunnerOutput(ids, toks, [None] * len(ids)), self.requests)
        self.computed += out.num_tokens
        return out

    def run(self, token=None) -> None:
        for _ in range(500):
            if not self.sched.has_unfinished:
                return
            assert not self.step(token).is_empty
        raise AssertionError("did not finish")

    def waiting(self) -> list[str]:
        return [r.request_id for r in self.sched.waiting]


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_longest_cached_prefix_first_ties_by_arrival():
    eng = Engine()
    a, b = tokens(1000, 12), tokens(2000, 12)
    eng.cache(a)  # 3 pages of a
    eng.cache(b[:4])  # 1 page of b
    eng.add("c", tokens(3000, 15))
    eng.add("b", b + [7, 8, 9])
    eng.add("a1", a + [5, 6, 7], arrival=3)
    eng.add("a0", a + [1, 2, 3], arrival=2)  # added last, arrived before a1
    out = eng.step()
    assert [(s.request_id, s.start) for s in out.requests] == [
        ("a0", 12),
        ("a1", 12),
        ("b", 4),
        ("c", 0),
    ]
    assert eng.kv.prefix_hit_tokens == 28


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_followers_wait_for_the_leader_then_hit(ignore_eos):
    eng = Engine()
    x, y = tokens(1000, 12), tokens(2000, 12)
    for i in range(3):  # round robin: x0 y0 x1 y1 x2 y2
        eng.add(f"x{i}", x + [10 + i] * 3, ignore_eos=ignore_eos)
        eng.add(f"y{i}", y + [20 + i] * 3, ignore_eos=ignore_eos)
    out = eng.step()
    assert [(s.request_id, s.start) for s in out.requests] == [("x0", 0), ("y0", 0)]
    assert eng.waiting() == ["x1", "y1", "x2", "y2"]
    out = eng.step()  # the leaders' prompts are computed: the followers hit them
    assert [(s.request_id, s.start, len(s.new_token_ids)) for s in out.requests] == [
        ("x0", 15, 1),
        ("y0", 15, 1),
        ("x1", 12, 3),
        ("y1", 12, 3),
        ("x2", 12, 3),
        ("y2", 12, 3),
    ]
    # EOS endings on: the leaders stop early, the followers still hit their pages
    eng.run(token=None if ignore_eos else (lambda r: EOS if r.request_id == "x0" else 100))
    assert eng.kv.prefix_hit_tokens == 4 * 12
    assert all(r.is_finished for r in eng.requests.values())
    assert not eng.sched.waiting._claims and not eng.sched.waiting._claimed


def test_arrival_admission_recomputes_the_shared_prefixes():
    eng = Engine(admission="arrival")
    x, y = tokens(1000, 12), tokens(2000, 12)
    for i in range(3):
        eng.add(f"x{i}", x + [10 + i] * 3)
        eng.add(f"y{i}", y + [20 + i] * 3)
    out = eng.step()
    assert [s.start for s in out.requests] == [0] * 6
    assert eng.kv.prefix_hit_tokens == 0


def test_a_deferred_request_does_not_block_the_others_and_waits_through_chunks():
    eng = Engine(budget=10)
    x = tokens(1000, 12)
    eng.add("x0", x + [1, 2, 3])
    eng.add("x1", x + [4, 5, 6])
    eng.add("z", tokens(3000, 7))
    out = eng.step()
    assert [(s.request_id, s.start, len(s.new_token_ids)) for s in out.requests] == [("x0", 0, 10)]
    # x0 computed pages 0-1; x1's first uncached page (2) is x0's to compute: z goes first
    out = eng.step()
    assert [(s.request_id, s.start, len(s.new_token_ids)) for s in out.requests] == [
        ("x0", 10, 5),
        ("z", 0, 5),
    ]
    assert eng.waiting() == ["x1"]
    out = eng.step()
    assert ("x1", 12, 3) in [(s.request_id, s.start, len(s.new_token_ids)) for s in out.requests]


def test_one_shared_page_is_not_serialised():
    eng = Engine()
    system = tokens(1000, 4)
    for i in range(5):
        eng.add(f"r{i}", system + tokens(2000 + 100 * i, 11))
    out = eng.step()  # all wait for the shared page, computed by r0
    assert [(s.request_id, s.start) for s in out.requests] == [("r0", 0)]
    out = eng.step()  # then every other request proceeds with its own pages, together
    assert [(s.request_id, s.start) for s in out.requests[1:]] == [
        (f"r{i}", 4) for i in range(1, 5)
    ]


def test_preempted_requests_resume_first_and_block_like_arrival():
    eng = Engine(num_pages=6)
    shared = tokens(1000, 12)
    eng.cache(shared)  # c has a 3-page cached prefix
    eng.cache(tokens(9000, 4), hold=True)  # 5 pages free
    eng.add("c", shared + [1, 2])  # needs 1 new page
    b = eng.add("b", tokens(2000, 21))  # needs 6: does not fit
    eng.sched.waiting.remove(b)  # make b a request preempted for recompute
    eng.sched.preempt(b)
    assert eng.waiting() == ["b", "c"]
    assert eng.step().is_empty  # b blocks c, as in arrival order
    eng.kv.forget(next(r for r in eng.kv.pages if r.startswith("warm")))
    out = eng.step()
    assert [(s.request_id, s.start) for s in out.requests] == [("b", 0)]
    assert eng.waiting() == ["c"]


def test_a_preempted_request_is_resumed_before_a_better_cached_one():
    eng = Engine(num_pages=8, seqs=3, budget=100)
    a = eng.add("a", tokens(1000, 4), max_tokens=20)
    b = eng.add("b", tokens(2000, 4), max_tokens=20)
    while eng.kv.num_free_pages or a.num_computed_tokens % PS:
        eng.step()  # until a and b fill the pool and both need a new page
    c = eng.add("c", a.token_ids[:8] + [9], max_tokens=2)  # a holds its 2 cached pages
    out = eng.step()
    assert out.preempted_ids == ["b"] and b.status == RequestStatus.WAITING
    assert eng.waiting() == ["b", "c"]
    for _ in range(30):
        out = eng.step()
        if b.status == RequestStatus.RUNNING:
            break
        assert c.status == RequestStatus.WAITING  # c (1 new page) never overtakes b
    ids = [s.request_id for s in out.requests]
    assert "b" in ids and ids.index("b") < ids.index("c") if "c" in ids else True
    eng.run()
    assert a.is_finished and b.is_finished and c.is_finished


def test_the_best_candidate_not_fitting_stops_admission():
    eng = Engine(num_pages=8)
    big = tokens(1000, 8)
    eng.cache(big)
    eng.add("small", tokens(3000, 3))
    eng.add("big", big + tokens(5000, 25))  # 2 cached pages and 7 new ones
    eng.cache(tokens(7000, 4), hold=True)  # one page held: big does not fit
    out = eng.step()
    assert out.is_empty and eng.waiting() == ["small", "big"]


def test_claims_go_when_the_leader_is_aborted():
    eng = Engine(budget=6)
    x = tokens(1000, 12)
    x0 = eng.add("x0", x + [1, 2, 3])
    eng.add("x1", x + [4, 5, 6])
    out = eng.step()  # x0 computed a page and a half; x1 waits for page 1
    assert [s.request_id for s in out.requests] == ["x0"]
    eng.sched.abort(x0)
    out = eng.step()  # nobody computes page 1 now: x1 does, from the cached page 0
    assert [(s.request_id, s.start) for s in out.requests] == [("x1", 4)]
    assert list(eng.sched.waiting._claimed) == ["x1"]


def test_without_prefix_caching_admission_is_in_arrival_order():
    eng = Engine(caching=False, budget=100)
    x = tokens(1000, 12)
    for i in range(3):
        eng.add(f"x{i}", x + [i] * 3)
    out = eng.step()
    assert [(s.request_id, s.start) for s in out.requests] == [("x0", 0), ("x1", 0), ("x2", 0)]


@pytest.mark.parametrize("admission", ["prefix", "arrival"])
def test_could_admit_asks_for_the_request_schedule_would_admit(admission):
    eng = Engine(budget=5, admission=admission)
    x = tokens(1000, 12)
    eng.add("x0", x + [1, 2, 3])
    eng.add("x1", x + [4, 5, 6])
    eng.step()  # x0 is still computing its prompt; under prefix admission x1 waits for it
    assert could_admit(eng.sched, eng.kv) == (admission == "arrival")


def test_could_admit_counts_the_cached_pages_running_requests_hold():
    eng = Engine(num_pages=10, budget=100)
    x = tokens(1000, 24)
    eng.add("x0", x + [1, 2, 3], max_tokens=10)
    eng.add("x1", x + [4, 5, 6])
    eng.step()
    assert eng.waiting() == ["x1"]
    eng.cache(tokens(5000, 8), hold=True)  # 2 pages: 1 left free
    assert eng.kv.num_free_pages == 1 < eng.kv.pages_needed(27)
    assert could_admit(eng.sched, eng.kv)  # x1's 6 prefix pages are held by x0
    out = eng.step()
    assert ("x1", 24) in [(s.request_id, s.start) for s in out.requests]


def test_a_step_costs_the_groups_not_the_waiting_pages():
    """W3's shape, scaled down: 64 prefixes x 32 questions, round robin. A schedule()
    looks up a few pages per group and per admitted request, not every waiting page."""
    ps, prefix_len, question_len = 16, 3000, 100
    kv = KVCacheManager(PageAllocator(40 * 200, True), ps)
    sched = Scheduler(kv, 256, 8192, 4096, [EOS])
    prefixes = [tokens(100_000 * (p + 1), prefix_len) for p in range(64)]
    reqs = {}
    for q in range(32):
        for p in range(64):
            rid = f"p{p}q{q}"
            ids = prefixes[p] + tokens(10_000 * (q + 1) + p * 100, question_len)
            reqs[rid] = Request(rid, ids, SamplingParams(max_tokens=1), 1, arrival=len(reqs))
            sched.add(reqs[rid])
    waiting_pages = sum((len(r.token_ids) - 1) // ps for r in reqs.values())
    calls = 0
    is_cached = kv.is_cached

    def counted(h):
        nonlocal calls
        calls += 1
        return is_cached(h)

    kv.is_cached = counted
    out = sched.schedule()  # leaders of the 64 prefixes fill the budget
    assert [(s.request_id, len(s.new_token_ids)) for s in out.requests] == [
        ("p0q0", 3100),
        ("p1q0", 3100),
        ("p2q0", 1992),
    ]
    assert calls <= 64
    sampled = [s.request_id for s in out.requests if s.sample]
    sched.update(out, ModelRunnerOutput(sampled, [100] * 2, [None] * 2), reqs)
    calls = 0
    out = sched.schedule()  # p0's and p1's prefixes are cached: their questions hit
    got = [(s.request_id, s.start) for s in out.requests]
    assert got[0] == ("p2q0", 1992)  # p0q0 and p1q0 finished (max_tokens=1)
    assert got[1:-1] == [(f"p{p}q{q}", 187 * ps) for q in range(1, 32) for p in (0, 1)]
    assert got[-1] == ("p3q0", 0)  # p2's questions wait for p2q0's prefix
    assert calls <= 2 * 64 + 2 * 32
    assert calls * 1000 < waiting_pages


def test_requests_sharing_nothing_are_not_looked_up_every_step():
    """A workload with nothing shared (W2's shape): after the first look every group is
    cold, and a step looks up only RECHECK of them again, in arrival order."""
    from batchgen.engine.waiting import RECHECK

    eng = Engine(num_pages=4096, seqs=4, budget=10_000)
    for i in range(2000):
        eng.add(f"r{i}", tokens(10 * i + 1_000_000, 40))
    calls = 0
    is_cached = eng.kv.is_cached

    def counted(h):
        nonlocal calls
        calls += 1
        return is_cached(h)

    eng.kv.is_cached = counted
    out = eng.step()
    assert [s.request_id for s in out.requests] == ["r0", "r1", "r2", "r3"]
    assert calls <= 2000 + 4
    for _ in range(5):
        calls = 0
        assert eng.sched.admission_candidate()[0].request_id == "r4"
        assert calls <= RECHECK + 4


def test_a_first_page_cached_without_a_claim_is_found_by_the_second_look():
    from batchgen.engine.waiting import RECHECK

    eng = Engine(num_pages=512)
    n = 3 * RECHECK
    for i in range(n):
        eng.add(f"r{i}", tokens(100 * i + 10_000, 13))
    target = eng.add("t", tokens(90_000, 13))
    assert eng.sched.admission_candidate()[0].request_id == "r0"  # all cold now
    eng.cache(target.token_ids[:12])  # cached behind the scheduler's back: no claim
    seen = [eng.sched.admission_candidate()[0].request_id for _ in range(n // RECHECK + 2)]
    assert seen[-1] == "t" and seen[0] == "r0"
