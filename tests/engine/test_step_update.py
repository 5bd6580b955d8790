"""The update of a step's results (engine/step_update.py) with no model: a row's token
stops it by its own stop sets only, and a blind decode step's update registers every
page its rows fill though it checks only the rows that can fill one."""

from __future__ import annotations

from batchgen.engine.pipeline import next_decode
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.page_allocator import PageAllocator
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput
from batchgen.sampling_params import SamplingParams

PS = 4
EOS = 2


def _engine(max_num_seqs: int = 8):
    kv = KVCacheManager(PageAllocator(64, True), PS)
    return kv, Scheduler(kv, max_num_seqs, 64, 1000, [EOS]), {}


def _add(sched: Scheduler, requests: dict, rid: str, prompt: list[int], **params) -> Request:
    max_tokens = params.pop("max_tokens", 40)
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens)
    requests[rid] = req
    sched.add(req)
    return req


def _result(step: SchedulerOutput, token) -> ModelRunnerOutput:
    """Every sampling row's token (`token(request id, start)`), as the runner reports it."""
    rows = [s for s in step.requests if s.sample]
    out = ModelRunnerOutput(
        [s.request_id for s in rows],
        [token(s.request_id, s.start) for s in rows],
        [None] * len(rows),
    )
    if len(rows) == len(step.requests):
        out.step_entries = step.requests
    return out


def _registered_as_due(kv: KVCacheManager, sched: Scheduler) -> None:
    """Every running request's full pages of known, computed tokens are registered."""
    for req in sched.running:
        due = min(req.num_computed_tokens, len(req.token_ids)) // PS
        assert kv._num_registered.get(req.request_id, 0) == due, req.request_id
        pages = kv.pages[req.request_id][:due]
        assert all(kv.allocator.page_hash(p) is not None for p in pages)


def test_a_stop_token_stops_only_the_requests_that_name_it():
    """The update checks a token against the union of every request's stop ids first; a
    token in it stops only a request whose own stop ids (or EOS) hold it, after its
    min_tokens."""
    kv, sched, requests = _engine()
    a = _add(sched, requests, "a", list(range(10, 15)), stop_token_ids=[77])
    b = _add(sched, requests, "b", list(range(20, 25)))
    c = _add(sched, requests, "c", list(range(30, 35)), stop_token_ids=[77], min_tokens=2)
    d = _add(sched, requests, "d", list(range(40, 45)), ignore_eos=True, stop_token_ids=[78])
    assert sched.stop_token_union == {77, 78}
    step = sched.schedule()
    sched.update(step, _result(step, lambda rid, start: 77 if rid != "d" else EOS), requests)
    assert (a.finish_reason, a.stop_reason) == ("stop", 77)
    assert not b.is_finished and not c.is_finished and not d.is_finished
    step = sched.schedule()
    sched.update(step, _result(step, lambda rid, start: 77 if rid != "d" else 78), requests)
    assert not b.is_finished
    assert (c.finish_reason, c.stop_reason) == ("stop", 77)
    assert (d.finish_reason, d.stop_reason) == ("stop", 78)
    step = sched.schedule()
    sched.update(step, _result(step, lambda rid, start: EOS), requests)
    assert (b.finish_reason, b.stop_reason) == ("stop", None)
    assert b.output_token_ids == [77, 77, EOS]


def test_blind_steps_register_every_page_as_it_fills():
    """Pipelined decode (each blind step built before the step it follows is updated):
    after every update each running request has exactly its full pages registered,
    rows of every phase against the page size."""
    kv, sched, requests = _engine()
    for i in range(6):
        _add(sched, requests, f"r{i}", list(range(100 * i, 100 * i + 3 + i)), ignore_eos=True)
    queued = sched.schedule()
    blind = 0
    for _ in range(20):
        following = next_decode(queued, sched, kv, requests, admit=False)
        sched.update(queued, _result(queued, lambda rid, start: 50 + start % 7), requests)
        _registered_as_due(kv, sched)
        assert following is not None
        queued = following[0]
        blind += queued.blind
    assert blind == 20
    assert not kv.behind
    # a blind step's update counts its rows' tokens computed in the same pass
    assert sched.num_computed_tokens_total == sum(r.num_computed_tokens for r in requests.values())


def test_a_blind_step_registers_a_page_left_behind():
    """A request whose last check left a full page unregistered (`KVCacheManager.behind`:
    a token of that page was in flight then) has it registered by the next blind step's
    update, though its count does not reach a page's end there."""
    kv, sched, requests = _engine()
    req = _add(sched, requests, "a", list(range(10, 17)), ignore_eos=True)  # 7 tokens
    queued = sched.schedule()
    for _ in range(2):  # the prompt, then position 7: 8 computed, two pages registered
        following = next_decode(queued, sched, kv, requests, admit=False)
        sched.update(queued, _result(queued, lambda rid, start: 60 + start), requests)
        queued = following[0]
    assert (req.num_computed_tokens, kv._num_registered["a"]) == (8, 2)
    # the state a check with position 7's token in flight leaves: one page registered
    kv._num_registered["a"] = 1
    kv.behind.add("a")
    sched.update(queued, _result(queued, lambda rid, start: 60 + start), requests)
    assert req.num_computed_tokens == 9
    assert kv._num_registered["a"] == 2
    assert "a" not in kv.behind


class _TierKV(KVCacheManager):
    """A KV manager whose `tier_active` a test sets (no tier behind it)."""

    tier_active = False


def test_with_the_host_tier_active_a_blind_step_keeps_two_passes(monkeypatch):
    """With the host tier active a blind step's counters take their own pass (`_advance`)
    before the tokens are appended: the pages it checks see only the tokens known before
    the step, as the tier's wanted hashes did; without it, one pass."""
    passes = []
    advance = Scheduler._advance

    def counted(self, sched, *args):
        passes.append(sched.blind)
        return advance(self, sched, *args)

    monkeypatch.setattr(Scheduler, "_advance", counted)
    for active in (False, True):
        passes.clear()
        kv = _TierKV(PageAllocator(64, True), PS)
        sched, requests = Scheduler(kv, 8, 64, 1000, [EOS]), {}
        for i in range(3):
            _add(sched, requests, f"r{i}", list(range(10 * i, 10 * i + 5)), ignore_eos=True)
        queued = sched.schedule()
        kv.tier_active = active  # from the decode steps on: nothing loads from a tier
        for _ in range(6):
            following = next_decode(queued, sched, kv, requests, admit=False)
            sched.update(queued, _result(queued, lambda rid, start: 50 + start), requests)
            _registered_as_due(kv, sched)
            queued = following[0]
        assert passes.count(True) == (5 if active else 0)
