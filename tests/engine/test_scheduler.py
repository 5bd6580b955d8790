"""Scheduler + KVCacheManager driven with fabricated ModelRunnerOutputs (no model).

Every test runs under both admission orders: with prompts that share no cached prefix,
prefix admission behaves as arrival admission (tests/engine/test_waiting.py covers where
they differ)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.page_allocator import PageAllocator
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput
from batchgen.sampling_params import SamplingParams

PS = 4
EOS = 2


@pytest.fixture(autouse=True, params=["prefix", "arrival"])
def admission(request, monkeypatch):
    monkeypatch.setattr(Driver, "admission", request.param)
    return request.param


class Driver:
    """Plays the engine's role: schedule, fabricate the sampled tokens, update.

    Every step checks the invariants the runner relies on."""

    admission = "prefix"

    def __init__(
        self,
        num_pages: int = 64,
        max_num_seqs: int = 8,
        budget: int = 64,
        max_model_len: int = 1000,
        caching: bool = True,
    ) -> None:
        self.kv = KVCacheManager(PageAllocator(num_pages, caching), PS)
        self.sched = Scheduler(
            self.kv, max_num_seqs, budget, max_model_len, [EOS], admission=self.admission
        )
        self.requests: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []
        self.finished: list[Request] = []
        self.held: dict[str, list[int]] = {}  # each request's pages, as the runner keeps them

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
        req = Request(
            rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens
        )
        self.requests[rid] = req
        self.sched.add(req)
        return req

    def step(self, token=None) -> SchedulerOutput:
        """One step; `token(request)` picks each sampled token (default: never EOS)."""
        token = token or (lambda r: 100 + len(r.output_token_ids))
        before = {r.request_id: r.num_computed_tokens for r in self.sched.running}
        out = self.sched.schedule()
        self.take_pages(out)
        self.check(out, before)
        sampled = [s for s in out.requests if s.sample]
        result = ModelRunnerOutput(
            [s.request_id for s in sampled],
            [token(self.requests[s.request_id]) for s in sampled],
            [None] * len(sampled),
        )
        self.sched.update(out, result, self.requests)
        for s in out.requests:
            req = self.requests[s.request_id]
            if req.is_finished and req not in self.finished:
                self.finished.append(req)
                assert s.request_id not in self.kv.pages  # pages released on finish
        self.outputs.append(out)
        return out

    def take_pages(self, out: SchedulerOutput) -> None:
        """The runner's record of page lists, from the step's diffs (runner/input_batch.py)."""
        for rid in out.released_ids:
            self.held.pop(rid, None)
        for s in out.requests:
            if s.new is not None:
                self.held[s.request_id] = list(s.new_pages)
            else:
                self.held[s.request_id] += s.new_pages

    def check(self, out: SchedulerOutput, before: dict[str, int]) -> None:
        sched = self.sched
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(out.requests) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        ids = [s.request_id for s in out.requests]
        assert len(ids) == len(set(ids))
        for s in out.requests:
            req = self.requests[s.request_id]
            n = len(s.new_token_ids)
            assert n >= 1
            assert req.status == RequestStatus.RUNNING
            assert s.start == req.num_computed_tokens
            if s.request_id in before and s.request_id not in out.preempted_ids:
                assert s.start == before[s.request_id]  # running: continues where it was
            assert s.new_token_ids == req.token_ids[s.start : s.start + n]
            assert len(self.held[s.request_id]) * PS >= s.start + n  # pages cover the new tokens
            assert s.sample == (s.start + n == req.num_tokens)
        for rid in out.preempted_ids:
            assert rid not in ids
            assert rid not in self.kv.pages
        # Ref counts equal the number of page tables holding each page.
        held = Counter(p for pages in self.kv.pages.values() for p in pages)
        for page, refs in enumerate(self.kv.allocator.ref_count):
            assert refs == held.get(page, 0), page
        assert self.kv.num_free_pages == self.kv.allocator.num_pages - len(held)
        assert set(self.kv.pages) == {r.request_id for r in sched.running}
        # prefix admission: only running requests claim the pages they compute
        assert set(getattr(sched.waiting, "_claimed", ())) <= set(self.kv.pages)

    def run(self, max_steps: int = 1000, token=None) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            out = self.step(token)
            assert not out.is_empty, "nothing scheduled with work left"
        raise AssertionError("did not finish")


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def test_single_request_prefill_then_decode_to_max_tokens():
    d = Driver()
    req = d.add("a", prompt(6), max_tokens=3)
    out = d.step()
    (s,) = out.requests
    assert (s.start, len(s.new_token_ids), s.sample) == (0, 6, True)
    assert req.num_computed_tokens == 6 and req.output_token_ids == [100]
    for expect_start in (6, 7):
        (s,) = d.step().requests
        assert (s.start, len(s.new_token_ids)) == (expect_start, 1)
    assert req.is_finished and req.finish_reason == "length"
    assert req.output_token_ids == [100, 101, 102]
    assert not d.sched.has_unfinished
    assert d.kv.num_free_pages == 64


def test_token_budget_respected_every_step():
    d = Driver(budget=10, max_num_seqs=16)
    lengths = [3, 17, 9, 1, 25, 4, 12, 7]
    for i, n in enumerate(lengths):
        d.add(f"r{i}", prompt(n, base=1000 * (i + 1)), max_tokens=5)
    d.run()
    assert all(0 < o.num_tokens <= 10 for o in d.outputs)
    assert sum(o.num_tokens for o in d.outputs) == sum(lengths) + len(lengths) * 4
    # The budget was actually the limit some of the time (work was waiting).
    assert max(o.num_tokens for o in d.outputs) == 10
    assert all(len(r.output_token_ids) == 5 for r in d.requests.values())


def test_chunked_prefill_splits_a_long_prompt():
    d = Driver(budget=8)
    req = d.add("a", prompt(20), max_tokens=2)
    chunks = []
    for _ in range(3):
        (s,) = d.step().requests
        chunks.append((s.start, len(s.new_token_ids), s.sample))
        assert d.held["a"] == d.kv.pages["a"]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.output_token_ids == [100]
    assert req.num_computed_tokens == 20
    (s,) = d.step().requests
    assert (s.start, len(s.new_token_ids), s.sample) == (20, 1, True)
    assert req.is_finished


def test_no_token_sampled_before_the_last_chunk():
    d = Driver(budget=5)
    req = d.add("a", prompt(12), max_tokens=1)
    d.step()
    d.step()
    assert req.output_token_ids == [] and req.num_computed_tokens == 10
    d.step()
    assert req.output_token_ids == [100] and req.is_finished


def test_decodes_and_a_prefill_chunk_share_a_step():
    d = Driver(budget=6)
    a = d.add("a", prompt(4, 1000), max_tokens=10)
    b = d.add("b", prompt(3, 2000), max_tokens=10)
    out = d.step()  # a's prompt (4) + 2 tokens of b's prompt
    assert [(s.request_id, s.start, len(s.new_token_ids), s.sample) for s in out.requests] == [
        ("a", 0, 4, True),
        ("b", 0, 2, False),
    ]
    d.add("c", prompt(20, 3000), max_tokens=10)
    out = d.step()  # a decodes, b finishes its prompt, c gets the rest of the budget
    got = [(s.request_id, s.start, len(s.new_token_ids), s.sample) for s in out.requests]
    assert got == [("a", 4, 1, True), ("b", 2, 1, True), ("c", 0, 4, False)]
    out = d.step()  # a and b decode; c's next chunk
    got = [(s.request_id, s.start, len(s.new_token_ids), s.sample) for s in out.requests]
    assert got == [("a", 5, 1, True), ("b", 3, 1, True), ("c", 4, 4, False)]
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 2


def test_running_requests_come_before_waiting_ones():
    d = Driver(budget=4)
    d.add("a", prompt(4, 1000), max_tokens=5)
    d.step()
    d.add("b", prompt(10, 2000), max_tokens=5)
    out = d.step()
    assert [(s.request_id, len(s.new_token_ids)) for s in out.requests] == [("a", 1), ("b", 3)]


def test_max_num_seqs_respected():
    d = Driver(max_num_seqs=2, budget=100)
    for i in range(5):
        d.add(f"r{i}", prompt(3, 1000 * (i + 1)), max_tokens=2)
    out = d.step()
    assert [s.request_id for s in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in d.sched.waiting] == ["r2", "r3", "r4"]
    d.run()
    assert all(len(o.requests) <= 2 for o in d.outputs)
    assert [r.request_id for r in d.finished] == ["r0", "r1", "r2", "r3", "r4"]


def test_admission_stops_when_pages_run_out_in_waves():
    d = Driver(num_pages=4, budget=100)
    for i in range(4):
        d.add(f"r{i}", prompt(8, 1000 * (i + 1)), max_tokens=1)  # 2 pages each
    out = d.step()
    assert [s.request_id for s in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in d.sched.waiting] == ["r2", "r3"]
    assert d.sched.waiting[0].num_computed_tokens == 0
    assert "r2" not in d.kv.pages
    assert d.sched.num_preemptions == 0
    out = d.step()  # r0 and r1 finished: the second wave fits
    assert [s.request_id for s in out.requests] == ["r2", "r3"]
    assert all(r.is_finished and len(r.output_token_ids) == 1 for r in d.requests.values())


def test_admission_is_fifo_a_blocked_head_blocks_smaller_requests():
    d = Driver(num_pages=4, budget=100)
    d.add("a", prompt(8, 1000), max_tokens=1)
    d.add("big", prompt(12, 2000), max_tokens=1)  # 3 pages: does not fit beside a
    d.add("small", prompt(2, 3000), max_tokens=1)
    out = d.step()
    assert [s.request_id for s in out.requests] == ["a"]
    assert [r.request_id for r in d.sched.waiting] == ["big", "small"]


def test_preemption_of_the_newest_running_request():
    # 4 pages of 4 tokens; max_num_seqs keeps c waiting.
    d = Driver(num_pages=4, max_num_seqs=2, budget=100)
    a = d.add("a", prompt(4, 1000), max_tokens=20)
    b = d.add("b", prompt(4, 2000), max_tokens=20)
    c = d.add("c", prompt(4, 3000), max_tokens=20)
    for _ in range(5):  # a and b fill 2 pages each (8 tokens computed)
        out = d.step()
        assert not out.preempted_ids
    assert a.num_computed_tokens == b.num_computed_tokens == 8
    assert d.kv.num_free_pages == 0
    out = d.step()  # both cross into a 3rd page: a (oldest) takes b's pages
    assert out.preempted_ids == ["b"]
    assert [s.request_id for s in out.requests] == ["a"]
    assert b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and d.sched.num_preemptions == 1
    assert "b" not in d.kv.pages
    assert list(d.sched.waiting) == [b, c]  # back at the front, ahead of c
    assert d.sched.running == [a]
    assert len(d.kv.pages["a"]) == 3
    assert d.kv.num_free_pages == 1
    assert len(b.output_token_ids) == 5  # its output so far is kept
    # Nothing is admitted in a step that preempted.
    assert not any(s.request_id == "c" for s in out.requests)


def test_preempted_request_is_recomputed_including_its_output():
    d = Driver(num_pages=4, max_num_seqs=2, budget=100)
    a = d.add("a", prompt(4, 1000), max_tokens=6)
    b = d.add("b", prompt(4, 2000), max_tokens=8)
    for _ in range(6):
        d.step()
    assert d.outputs[-1].preempted_ids == ["b"]
    assert b.status == RequestStatus.WAITING and a.is_finished
    assert len(b.output_token_ids) == 5
    # b comes back: its known tokens (prompt + 5 outputs) are prefilled again, except
    # its head page, which survived in the prefix cache (a evicted its tail page).
    out = d.step()
    (s,) = out.requests
    assert s.request_id == "b"
    assert (s.start, len(s.new_token_ids), s.sample) == (4, 5, True)
    assert s.new_token_ids == b.token_ids[4:9]
    assert b.output_token_ids[-1] == 105
    d.run()
    assert b.is_finished and len(b.output_token_ids) == 8
    assert b.output_token_ids == [100 + i for i in range(8)]


@pytest.mark.parametrize("caching", [True, False])
def test_small_pool_full_run_every_request_completes(caching):
    d = Driver(num_pages=8, max_num_seqs=6, budget=12, caching=caching)
    expect = {}
    for i in range(8):
        n, m = 3 + (5 * i) % 9, 4 + (3 * i) % 10
        d.add(f"r{i}", prompt(n, 1000 * (i + 1)), max_tokens=m)
        expect[f"r{i}"] = m
    d.run()
    assert d.sched.num_preemptions > 0  # the pool was really too small
    assert not d.sched.running and not d.sched.waiting
    for rid, m in expect.items():
        req = d.requests[rid]
        assert req.is_finished and req.finish_reason == "length"
        assert req.output_token_ids == [100 + k for k in range(m)]
    assert d.kv.num_free_pages == 8
    assert all(r == 0 for r in d.kv.allocator.ref_count)


def test_stop_on_eos():
    d = Driver()
    req = d.add("a", prompt(5), max_tokens=10)
    d.step()
    d.step(lambda r: EOS)
    assert req.is_finished
    assert (req.finish_reason, req.stop_reason) == ("stop", None)
    assert req.output_token_ids == [100, EOS]
    assert "a" not in d.kv.pages


def test_ignore_eos_keeps_going_to_max_tokens():
    d = Driver()
    req = d.add("a", prompt(5), max_tokens=4, ignore_eos=True)
    d.run(token=lambda r: EOS)
    assert req.finish_reason == "length"
    assert req.output_token_ids == [EOS] * 4


def test_stop_token_ids():
    d = Driver()
    req = d.add("a", prompt(5), max_tokens=10, stop_token_ids=[77])
    d.step()
    d.step(lambda r: 76)
    assert not req.is_finished
    d.step(lambda r: 77)
    assert (req.finish_reason, req.stop_reason) == ("stop", 77)
    assert req.output_token_ids == [100, 76, 77]


def test_stop_token_ids_apply_even_with_ignore_eos():
    d = Driver()
    req = d.add("a", prompt(5), max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    d.step(lambda r: 77)
    assert (req.finish_reason, req.stop_reason) == ("stop", 77)


@pytest.mark.parametrize("stopper", ["eos", "stop_token"])
def test_min_tokens_defers_stops(stopper):
    d = Driver()
    tok = EOS if stopper == "eos" else 77
    req = d.add("a", prompt(5), max_tokens=10, min_tokens=3, stop_token_ids=[77])
    d.step(lambda r: tok)
    d.step(lambda r: tok)
    assert not req.is_finished and len(req.output_token_ids) == 2
    d.step(lambda r: tok)
    assert req.is_finished and req.finish_reason == "stop"
    assert len(req.output_token_ids) == 3


def test_max_tokens_gives_length():
    d = Driver()
    req = d.add("a", prompt(5), max_tokens=3)
    d.run()
    assert req.finish_reason == "length" and req.stop_reason is None
    assert len(req.output_token_ids) == 3
    assert len(d.outputs) == 3


def test_max_model_len_gives_length():
    d = Driver(max_model_len=10)
    req = d.add("a", prompt(6), max_tokens=100)
    d.run()
    assert req.finish_reason == "length"
    assert req.num_tokens == 10
    assert len(req.output_token_ids) == 4


def test_eos_wins_over_length_on_the_last_token():
    d = Driver()
    req = d.add("a", prompt(5), max_tokens=2)
    d.step()
    d.step(lambda r: EOS)
    assert (req.finish_reason, len(req.output_token_ids)) == ("stop", 2)


def test_prefix_hits_advance_num_computed_tokens_at_admission():
    d = Driver()
    shared = prompt(10)
    d.add("a", shared, max_tokens=1)
    d.run()
    b = d.add("b", shared + [7, 8], max_tokens=1)
    out = d.step()
    (s,) = out.requests
    assert s.start == 8  # two full pages of a's prompt were cached
    assert s.new_token_ids == [1008, 1009, 7, 8]
    assert b.num_computed_tokens == 12
    assert d.kv.prefix_hit_tokens == 8
    assert b.is_finished and len(b.output_token_ids) == 1


def test_prefix_hit_of_an_exact_page_multiple_recomputes_the_last_page():
    d = Driver()
    shared = prompt(8)
    d.add("a", shared, max_tokens=1)
    d.run()
    d.add("b", list(shared), max_tokens=1)
    (s,) = d.step().requests
    assert (s.start, len(s.new_token_ids), s.sample) == (4, 4, True)


def test_prefix_hits_shared_between_running_requests():
    d = Driver(budget=100)
    shared = prompt(8)
    a = d.add("a", shared + [1], max_tokens=6)
    d.step()
    b = d.add("b", shared + [5, 6], max_tokens=6)
    out = d.step()
    sb = next(s for s in out.requests if s.request_id == "b")
    assert sb.start == 8
    assert d.kv.pages["b"][:2] == d.kv.pages["a"][:2]
    d.run()
    assert a.is_finished and b.is_finished
    assert all(r == 0 for r in d.kv.allocator.ref_count)


class KVContentDriver(Driver):
    """Also plays the model's KV writes: each slot remembers the token written there, and
    every scheduled request must find its earlier tokens in its pages (prefix hits,
    sharing, eviction and preemption must never hand out a page with other content)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.slots: dict[int, int] = {}

    def check(self, out: SchedulerOutput, before: dict[str, int]) -> None:
        super().check(out, before)
        for s in out.requests:
            req = self.requests[s.request_id]
            table = self.held[s.request_id]  # the runner's page row
            for pos in range(s.start):
                slot = table[pos // PS] * PS + pos % PS
                assert self.slots.get(slot) == req.token_ids[pos], (s.request_id, pos)
            for pos in range(s.start, s.start + len(s.new_token_ids)):
                self.slots[table[pos // PS] * PS + pos % PS] = req.token_ids[pos]


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_shared_prefixes_and_small_pool(seed):
    rng = random.Random(seed)
    d = KVContentDriver(
        num_pages=rng.choice([8, 10, 14]),
        max_num_seqs=rng.choice([2, 4, 8]),
        budget=rng.choice([5, 9, 16, 40]),
    )
    heads = [[rng.randrange(10, 500) for _ in range(rng.choice([4, 6, 8]))] for _ in range(3)]
    expect = {}
    for i in range(14):
        tail = [rng.randrange(10, 500) for _ in range(rng.randrange(0, 6))]
        p = rng.choice(heads) + tail if rng.random() < 0.8 else tail + [11]
        m = rng.randrange(1, 12)
        d.add(f"r{i}", p, max_tokens=m, min_tokens=min(m, rng.choice([0, 0, 2])))
        expect[f"r{i}"] = m

    def token(req):
        if rng.random() < 0.1:
            return EOS
        return 20 + (int(req.request_id[1:]) * 31 + req.num_tokens * 7) % 400

    d.run(token=token)
    for rid, m in expect.items():
        req = d.requests[rid]
        assert req.is_finished
        n = len(req.output_token_ids)
        if req.finish_reason == "length":
            assert n == m
        else:
            assert req.finish_reason == "stop" and req.output_token_ids[-1] == EOS
            assert req.params.min_tokens <= n <= m
    assert all(r == 0 for r in d.kv.allocator.ref_count)
    assert d.kv.num_free_pages == d.kv.allocator.num_pages


class CommittingDriver(Driver):
    """Commits every step before its update, as async scheduling does at a launch: the
    update then applies the committed step (the two-pass path) instead of advancing and
    appending in one pass."""

    def check(self, out: SchedulerOutput, before: dict[str, int]) -> None:
        super().check(out, before)
        self.sched.commit(out, self.requests)


def test_one_pass_update_matches_commit_then_apply():
    """A step nobody committed is updated in one pass (Scheduler._advance/_append); the
    same workload through commit + apply ends with the same tokens, finish reasons,
    counters and prefix cache."""

    def token(req):
        h = (int(req.request_id[1:]) * 131 + req.num_tokens * 17) % 97
        return EOS if h < 6 else 20 + h

    runs = []
    for cls in (Driver, CommittingDriver):
        d = cls(num_pages=12, max_num_seqs=4, budget=9)
        for i in range(10):
            d.add(f"r{i}", prompt(3 + i % 7, base=100 * (i % 3)), max_tokens=2 + i % 5)
        d.run(token=token)
        runs.append(
            (
                {r: (q.output_token_ids, q.finish_reason) for r, q in d.requests.items()},
                d.sched.num_computed_tokens_total,
                d.sched.num_prompt_tokens_computed,
                d.kv.prefix_hit_tokens,
                d.kv.num_free_pages,
            )
        )
    assert runs[0] == runs[1]
    reasons = {reason for _, reason in runs[0][0].values()}
    assert reasons == {"stop", "length"}  # both endings exercised
