"""Whether every row of a step is plain greedy (runner/input_batch.py: a flag a page row,
set as the row is taken, and how many held rows are and are not) against the walk over
the rows' params it replaced (`step_columns.plain_greedy` of each), as rows turn from
greedy to sampled and back, are released, re-sent and reused, and steps queue behind
others (pipelined decode, async scheduling)."""

from __future__ import annotations

import random

import numpy as np
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.runner.batch import BlindEntries, NewRequest, ScheduledRequest, SchedulerOutput
from batchgen.runner.input_batch import InputBatch
from batchgen.runner.step_columns import plain_greedy

# every condition of the predicate, each alone: the first two are plain greedy
PLAIN = [SamplingParams(temperature=0.0), SamplingParams(temperature=5e-6)]
OTHER = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=2e-5),  # just above SAMPLING_EPS
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, min_tokens=3),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.1),
]


def _walk(rows) -> bool:
    return all(plain_greedy(f.params) for f in rows.fixed)


def _pick(gen: random.Random, phase: str) -> SamplingParams:
    """A new request's params: phases of only plain greedy, mixed, only not."""
    if phase == "plain" or (phase == "mixed" and gen.random() < 0.6):
        return gen.choice(PLAIN)
    return gen.choice(OTHER)


def _check(rows, held: dict) -> str:
    """Assert the step's answer (and its sampling rows') equals the walk's; returns
    which way the step took it: 'all' (every held row alike) or 'rows' (its flags)."""
    assert rows.plain_greedy() == _walk(rows)
    sampled = rows.sampled()
    assert sampled.plain_greedy() == _walk(sampled)
    kinds = {plain_greedy(p) for p in held.values()}
    if len(kinds) == 1:  # the held rows' counts decide, none of the step's flags read
        assert rows.plain is kinds.pop()
        return "all"
    assert isinstance(rows.plain, np.ndarray)
    return "rows"


def test_a_steps_plain_greedy_equals_the_walk_over_its_rows():
    """Requests join, leave, are re-sent with other params (a row turns from greedy to
    sampled and back) over phases of only greedy, mixed and only sampled rows; steps
    with rows that do not sample and blind steps: each step's answer, and its sampling
    rows', is the walk's when taken and still after the next steps release and reuse
    its rows (a deferred sampling asks later); where every held row is alike no flag is
    read."""
    # the predicate keeps every condition: each of OTHER fails exactly one
    assert [plain_greedy(p) for p in PLAIN + OTHER] == [True] * 2 + [False] * len(OTHER)
    gen = random.Random(0)
    batch = InputBatch(8, 4)
    held: dict[str, SamplingParams] = {}
    kept, seen, made = [], {"all": 0, "rows": 0}, 0
    phases = ["plain"] * 8 + ["mixed"] * 12 + ["other"] * 8 + ["mixed"] * 8 + ["plain"] * 8
    for phase in phases:
        done = [rid for rid in held if gen.random() < 0.25]
        if phase != "mixed":  # the rows of the other kind leave
            done += [rid for rid in held if plain_greedy(held[rid]) != (phase == "plain")]
        done = list(dict.fromkeys(done))
        for rid in done:
            del held[rid]
        entries = []
        for rid in list(held):
            if phase == "mixed" and gen.random() < 0.1:  # re-sent whole, other params
                p = held[rid] = _pick(gen, phase)
                new = NewRequest(p, [1, 2, 3], [4], None)
                entries.append(ScheduledRequest(rid, [5], 4, [made], True, 1, None, new))
                continue
            sample = gen.random() < 0.8  # a prefill chunk's row does not sample
            entries.append(ScheduledRequest(rid, [-1], 9, (), sample, 2))
        while len(held) < 6:
            rid = f"r{made % 11}"  # ids come back once their request is gone
            made += 1
            if rid in held:
                continue
            p = held[rid] = _pick(gen, phase)
            new = NewRequest(p, [1, 2, 3], [], None)
            entries.append(ScheduledRequest(rid, [7], 3, [made], True, 0, None, new))
        gen.shuffle(entries)
        rows = batch.apply(SchedulerOutput(entries, released_ids=done))
        seen[_check(rows, held)] += 1
        kept.append(rows)
        if gen.random() < 0.4:  # the decode step after it, blind
            ids = [r.request_id for r in entries]
            blind = BlindEntries(ids, [10] * len(ids), [3] * len(ids), {})
            rows = batch.apply(SchedulerOutput(blind, blind=True))
            seen[_check(rows, held)] += 1
            kept.append(rows)
        for old in kept:  # taken when applied: what later steps did changes nothing
            assert old.plain_greedy() == _walk(old)
    assert seen["all"] > 10 and seen["rows"] > 10, seen
    answers = {r.plain_greedy() for r in kept}
    assert answers == {True, False}
    batch.reset()
    rows = batch.apply(SchedulerOutput([]))
    assert rows.plain is True and rows.plain_greedy()


KW = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_model_len=96,
    max_num_batched_tokens=64,
    deterministic=True,
    seed=3,
)


def _launched(runner) -> list:
    """Wrap the runner's launches: the list gets (flight, walk's answer when launched,
    queued behind another) for each."""
    out = []
    for name in ("launch_decode", "launch_step"):
        launch = getattr(runner, name)

        def recorded(sched, prev=None, *copies, launch=launch):
            flight = launch(sched, prev, *copies)
            sampled = flight.sampled
            walk = all(plain_greedy(r.params) for r in getattr(sampled, "fixed", sampled))
            out.append((flight, walk, prev is not None))
            return flight

        setattr(runner, name, recorded)
    return out


def test_pipelined_steps_plain_greedy_as_rows_turn_and_leave(tmp_path):
    """Greedy requests run beside sampled ones that end early, then beside greedy ones
    with logprobs, min_tokens or a penalty, four rows at a time (the rest wait for a
    row, so rows are released and reused mid-run): with pipelined decode and with async
    scheduling, every queued step's answer is the walk's over its sampling rows, steps
    of both answers are queued behind another, and the outputs are those of plain
    stepping."""
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    rng = random.Random(5)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(3, 12))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = [
        greedy,
        greedy,
        SamplingParams(temperature=0.9, seed=4, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=1, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=4, max_tokens=7),
        SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    ]
    base = LLM(model=str(tmp_path), pipeline_decode=False, async_scheduling=False, **KW)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    for kw in (dict(), dict(async_scheduling=True)):
        llm = LLM(model=str(tmp_path), max_num_seqs=4, **KW, **kw)
        launched = _launched(llm.engine.runner)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        for flight, walk, _ in launched:
            assert flight.plain_greedy() == walk
            assert flight.sampled.plain_greedy() == walk  # uncached, after the run
        behind = {walk for _, walk, queued in launched if queued}
        assert behind == {True, False}, kw
