"""The mixed-endings workload of the host-tier matrix (tests/kv/test_tier_matrix*.py).

One batch in which requests end differently: by EOS (the tiny model is rebuilt with an
eos_token_id its greedy outputs reach midway), by a stop token id, by a stop string, by
max_tokens; plus a shared-prefix part whose prefix pages a small device pool evicts
while the host tier keeps them. Everything is planned from a probe run (tier off,
ignore_eos) so each kind of ending is built in, then counted in the tier-off reference.
"""

from __future__ import annotations

import random
from collections import Counter

from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

ARCH = "Qwen3ForCausalLM"
MAX_TOKENS = 32
KINDS = ("eos", "stop_token", "stop_string", "length")


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """14 unrelated prompts, then 2 prefixes of 6 pages (page_size 4) shared by 3 prompts
    each: the first sharer runs early, the others come last, after the pool has turned
    over several times."""
    rng = random.Random(seed)
    words = lambda n: [rng.randint(3, 500) for _ in range(n)]  # noqa: E731
    prompts = [words(rng.randint(8, 30)) for _ in range(14)]
    prefixes = [words(24), words(24)]
    prompts[1] = prefixes[0] + words(5)
    prompts[2] = prefixes[1] + words(3)
    prompts += [p + words(rng.randint(2, 7)) for p in prefixes for _ in range(2)]
    return prompts


def _first_new(ids: list[int], lo: int, hi: int) -> int | None:
    """The first position in [lo, hi) whose token does not occur earlier (nor is special)."""
    for i in range(lo, min(hi, len(ids))):
        if ids[i] >= 3 and ids[i] not in ids[:i]:
            return i
    return None


def plan(probe: list[list[int]]) -> tuple[list[int], list[SamplingParams]]:
    """From greedy ignore_eos outputs: the EOS ids to build the model with (two, as Llama 3
    has), and per-request params; request i is meant to end by KINDS[i % 4]."""
    uncovered = [ids for i, ids in enumerate(probe) if i % 4 == 0]
    others = Counter(t for i, ids in enumerate(probe) if i % 4 for t in set(ids[:8]))
    eos: list[int] = []
    for _ in range(2):  # each covers the most EOS-group outputs midway, none too early
        score = Counter(
            t for ids in uncovered for t in set(ids[3 : MAX_TOKENS - 4]) - set(ids[:3]) if t >= 3
        )
        best = max(score, key=lambda t: (score[t], -others[t], -t))
        eos.append(best)
        uncovered = [ids for ids in uncovered if best not in ids[: MAX_TOKENS - 4]]
    params = []
    for i, ids in enumerate(probe):
        want = KINDS[i % 4]
        p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        at = _first_new(ids, 4 + i % 5, MAX_TOKENS - 2)
        if want == "stop_token" and at is not None:
            p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[ids[at]])
        elif want == "stop_string" and at is not None and ids[at + 1] >= 3:
            stop = f"w{ids[at]} w{ids[at + 1]}"
            p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
        elif want == "length":
            p = SamplingParams(temperature=0, max_tokens=5 + i % 11)
        params.append(p)
    return eos, params


def build(tmp_path_factory, **engine_kwargs) -> tuple[str, list[list[int]], list[SamplingParams]]:
    """Save the tiny model, probe it (tier off), then save it again (same seed, same
    weights) with the planned eos_token_id. Returns its path, the prompts and params."""
    prompts = mixed_prompts()
    plain = tmp_path_factory.mktemp("tier-matrix-probe")
    save_tiny_model(plain, ARCH)
    llm = LLM(model=str(plain), **engine_kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    probe = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    del llm
    eos, params = plan(probe)
    path = tmp_path_factory.mktemp("tier-matrix")
    save_tiny_model(path, ARCH, eos_token_id=eos)
    return str(path), prompts, params


def rows(outputs) -> list[tuple]:
    """What must match the reference: token ids, finish_reason, stop_reason, text."""
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, c.text)
        for c in (o.outputs[0] for o in outputs)
    ]


def request_row(req) -> tuple:
    """rows() of an engine Request driven by hand."""
    return (req.output_token_ids, req.finish_reason, req.stop_reason, req.text)


def kind(finish_reason: str | None, stop_reason) -> str:
    if finish_reason == "stop":
        if stop_reason is None:
            return "eos"
        return "stop_string" if isinstance(stop_reason, str) else "stop_token"
    return finish_reason or "unfinished"


def endings(rows_: list[tuple]) -> Counter:
    return Counter(kind(r[1], r[2]) for r in rows_)


def spy_finishes(engine) -> Counter:
    """Count, per ending kind, the requests that ended while a queued pipelined step
    held them (its extra token must then be discarded)."""
    seen: Counter = Counter()
    finish = engine.scheduler.finish

    def spy(req, reason, stop_reason=None):
        queued = engine._in_flight
        if queued is not None and any(
            r.request_id == req.request_id for r in queued.sched.requests
        ):
            seen[kind(reason, stop_reason)] += 1
        return finish(req, reason, stop_reason)

    engine.scheduler.finish = spy
    return seen


def assert_nothing_held(engine) -> None:
    """No request, device page or host page is held once the engine is idle and the
    tier's copies have completed (a copy holds its pages until then); host pages may
    stay cached (ref count 0) for later prefix hits."""
    assert not engine.has_unfinished and not engine.requests
    assert not engine.kv.pages
    if engine.tier is not None:
        assert not engine.kv._swapped and not engine.kv._demand  # nothing kept for anyone
        engine.tier.drain()
        held = [p for p, r in enumerate(engine.tier.host_alloc.ref_count) if r]
        assert not held, f"host pages still referenced: {held[:10]}"
    held = [p for p, r in enumerate(engine.kv.allocator.ref_count) if r]
    assert not held, f"device pages still referenced: {held[:10]}"
    assert engine.kv.num_free_pages == engine.pool.num_pages


def spy_stores_ahead(engine) -> list[str]:
    """Record, in order, each step, schedule() and launch_decode call and each store
    ahead submitted ("step", "schedule", "launch", "ahead")."""
    events: list[str] = []
    schedule, launch, step = engine.scheduler.schedule, engine.runner.launch_decode, engine._step
    submit_store = engine.tier._submit_store

    def stepped():
        events.append("step")
        return step()

    def scheduled(*a, **k):
        events.append("schedule")
        return schedule(*a, **k)

    def launched(*a, **k):
        events.append("launch")
        return launch(*a, **k)

    def stored(q, hold_dev, background=False):
        if background:
            events.append("ahead")
        return submit_store(q, hold_dev, background)

    engine.scheduler.schedule, engine.runner.launch_decode = scheduled, launched
    engine.tier._submit_store, engine._step = stored, stepped
    return events


def assert_stores_ahead_follow_a_launch(events: list[str]) -> None:
    """Each store ahead was submitted after a launch of its own step, with no schedule
    (nor a new step) between them."""
    assert "ahead" in events
    for i, e in enumerate(events):
        if e == "ahead":
            before = [x for x in events[:i] if x != "ahead"]
            assert before and before[-1] == "launch", events[max(0, i - 4) : i + 1]
