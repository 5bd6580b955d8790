"""SamplingState (runner/sampler.py): the running requests' sampling parameters kept by
request id, against SamplingMetadata.build made afresh for each step."""

from __future__ import annotations

import random

import torch

from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.sampler import SamplingMetadata, SamplingState
from batchgen.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 41
EOS = [2]

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, seed=5),
    SamplingParams(temperature=1.0, top_k=7, min_p=0.1, logprobs=3),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.2),
    SamplingParams(temperature=1.2, min_tokens=4, stop_token_ids=[9, 99]),
    SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=0),
]

TENSORS = ("temperature", "top_p", "top_k", "min_p", "seeds", "positions",
           "presence_penalty", "frequency_penalty", "repetition_penalty",
           "output_token_counts", "prompt_token_mask")  # fmt: skip
SCALARS = ("all_greedy", "max_logprobs", "min_tokens_block", "max_top_k", "use_top_k",
           "use_top_p", "use_min_p", "need_logprobs")  # fmt: skip


def assert_same(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for name in TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name


def test_kept_state_equals_a_fresh_build_each_step():
    """Rows in changing order, requests leaving (their slots reused by new ones), tokens
    recorded into kept penalty counts: every step's metadata equals a fresh build."""
    gen = random.Random(0)
    kept, fresh_counts = PenaltyCounts(VOCAB, CPU), PenaltyCounts(VOCAB, CPU)
    state = SamplingState(VOCAB, CPU, EOS, penalty_counts=kept)
    live = {}  # id -> (params, seed, prompt, output)
    next_id = 0
    for _ in range(8):
        while len(live) < 5:
            p = PARAMS[next_id % len(PARAMS)]
            prompt = [gen.randrange(VOCAB) for _ in range(4)]
            live[f"r{next_id}"] = (p, 1000 + next_id, prompt, [])
            next_id += 1
        ids = list(live)
        gen.shuffle(ids)
        args = (
            [live[i][0] for i in ids],
            [live[i][2] for i in ids],
            [live[i][3] for i in ids],
        )
        seeds = [live[i][1] for i in ids]
        got = state.build(ids, *args, seeds=seeds)
        want = SamplingMetadata.build(
            *args, VOCAB, CPU, EOS, seeds=seeds, penalty_counts=fresh_counts, request_ids=ids
        )
        assert_same(got, want)
        tokens = torch.tensor([gen.randrange(VOCAB) for _ in ids])
        got.record(tokens)
        want.record(tokens)
        for rid, t in zip(ids, tokens.tolist()):
            live[rid][3].append(t)
        done = ids[:2]
        for rid in done:
            del live[rid]
        state.release(done)
        kept.release(done)
        fresh_counts.release(done)
    assert len(state) == 3


def test_a_request_keeps_its_drawn_seed_and_a_reused_id_is_read_again():
    state = SamplingState(VOCAB, CPU, EOS, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.9)
    first = state.build(["a", "b"], [p, p], [[], []], [[], []])
    again = state.build(["b", "a"], [p, p], [[], []], [[1], [1]])
    assert torch.equal(again.seeds, first.seeds.flip(0))  # drawn once, then kept
    assert first.seeds[0] != first.seeds[1]
    assert again.positions.tolist() == [1, 1]
    other = SamplingParams(temperature=0.0, seed=77)
    reused = state.build(["a"], [other], [[]], [[]])  # the id "a" now names another request
    assert reused.all_greedy and reused.seeds.tolist() == [77]


def test_min_tokens_blocks_until_the_step_reaches_it():
    state = SamplingState(VOCAB, CPU, EOS)
    p = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[9, 99], seed=1)
    q = SamplingParams(temperature=1.0, min_tokens=2, ignore_eos=True, seed=2)
    blocked = [state.build(["a", "b"], [p, q], [[], []], [[], []], steps=[k, k])
               for k in range(3)]  # fmt: skip
    assert blocked[0].min_tokens_block == [(0, [2, 9])]  # q forbids nothing: no EOS, no stop ids
    assert blocked[1].min_tokens_block == [(0, [2, 9])]
    assert blocked[2].min_tokens_block == []


def test_build_for_scheduled_requests_equals_build():
    """build_for reads the runner's request objects as build reads its lists, token lists
    only where a row is penalised (a request without them would fail otherwise)."""
    from types import SimpleNamespace

    reqs = [
        SimpleNamespace(request_id=f"q{i}", params=p, seed=40 + i,
                        prompt_token_ids=[1, 3], output_token_ids=[4] * i)
        for i, p in enumerate(PARAMS)
    ]  # fmt: skip
    for r in reqs:
        if not r.params.has_penalties:
            del r.prompt_token_ids, r.output_token_ids
    steps = [3 + i for i in range(len(reqs))]
    penalised = [r if r.params.has_penalties else None for r in reqs]
    got = SamplingState(VOCAB, CPU, EOS).build_for(reqs, steps)
    want = SamplingState(VOCAB, CPU, EOS).build(
        [r.request_id for r in reqs],
        [r.params for r in reqs],
        [r.prompt_token_ids if r else [] for r in penalised],
        [r.output_token_ids if r else [] for r in penalised],
        steps,
        [r.seed for r in reqs],
    )
    assert_same(got, want)
    assert got.seeds.tolist()[1] == 41 and got.positions.tolist() == steps


def test_a_steps_flags_skip_only_what_no_held_request_uses():
    """A step's columns skip the reductions of what no held request uses (`absent`):
    each flag, the min_tokens blocks and the penalised rows equal the columns' own
    reductions, as requests of each kind come and go (the skipped bits come back when a
    request that uses them is added, and go again when it leaves)."""
    from dataclasses import replace

    from batchgen.runner import step_columns as sc

    gen = random.Random(1)
    state = SamplingState(VOCAB, CPU, EOS)
    live: dict[str, SamplingParams] = {}
    seen_absent = set()
    for step in range(40):
        if step % 10 == 0:  # whole batches of one kind, then mixed
            state.release(list(live))
            live.clear()
        pool = PARAMS[step // 10 % 2 : step // 10 % 2 + 1] if step < 20 else PARAMS
        while len(live) < 8:
            live[f"r{step}-{len(live)}-{gen.random()}"] = gen.choice(pool)
        ids = list(live)
        gen.shuffle(ids)
        steps = [gen.randrange(6) for _ in ids]
        params = [live[i] for i in ids]
        cols = state.columns(ids, params, [[1]] * len(ids), [[]] * len(ids), steps)
        full = replace(cols, absent=0)
        for name in ("all_greedy", "max_top_k", "use_top_p", "use_min_p", "need_logprobs",
                     "max_logprobs"):  # fmt: skip
            assert getattr(cols, name) == getattr(full, name), (step, name)
        want_pen = [i for i, p in enumerate(params) if p.has_penalties]
        assert cols.penalised == want_pen
        want_block = [i for i, p in enumerate(params) if steps[i] < p.min_tokens]
        assert [i for i, _ in cols.min_tokens_block] == want_block
        seen_absent.add(cols.absent)
        for rid in ids[: gen.randrange(4)]:
            del live[rid]
            state.release([rid])
    greedy_only = sc.SAMPLED | sc.TOP_P | sc.MIN_P | sc.TOP_K | sc.LOGPROBS | sc.MIN_TOKENS
    assert greedy_only | sc.PENALISED in seen_absent  # PARAMS[0] alone: nothing but greedy
    assert any(a & sc.GREEDY and not a & sc.TOP_P for a in seen_absent)  # PARAMS[1] alone
    assert 0 in seen_absent  # every kind held at once
