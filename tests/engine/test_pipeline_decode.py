"""Pipelined decode (the next decode step queued before this one's tokens reach the
host) gives exactly the outputs of plain stepping: length limits, unforeseeable stops
(stop tokens, stop strings) whose queued extra token is discarded, admission of waiting
requests, preemption under a small pool, and nothing left held afterwards."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import count_launches_ahead, save_tiny_model

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randint(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def _run(model_dir, prompts, params, pipeline: bool, **kw):
    llm = LLM(model=str(model_dir), pipeline_decode=pipeline, **{**KW, **kw})
    runner = llm.engine.runner
    launches = []
    launch = runner.launch_decode

    def counted(sched, prev=None, *copies):
        if sched.blind:  # built by next_decode: one placeholder a row, every row sampling
            assert prev is not None
            assert all(r.new_token_ids == [-1] and r.sample for r in sched.requests)
        launches.append(sched.blind)
        return launch(sched, prev, *copies)

    runner.launch_decode = counted
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished and not engine.requests
    assert engine.kv.num_free_pages == engine.kv.allocator.num_pages
    rows = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    return rows, sum(launches), engine


def _same(model_dir, prompts, params, **kw):
    plain, queued, plain_engine = _run(model_dir, prompts, params, False, **kw)
    assert queued == 0
    piped, queued, engine = _run(model_dir, prompts, params, True, **kw)
    assert queued > 0, "no decode step was built blind and queued ahead"
    assert piped == plain
    # the tokens counted computed: a discarded queued token is not among them
    counted = ("num_computed_tokens_total", "num_prompt_tokens_computed")
    assert [getattr(engine.scheduler, c) for c in counted] == [
        getattr(plain_engine.scheduler, c) for c in counted
    ]
    return plain, engine


def test_length_limits_and_admission(model_dir):
    prompts = _prompts(20)
    params = [
        SamplingParams(temperature=0, max_tokens=1 + i % 9, ignore_eos=True) for i in range(20)
    ]
    _same(model_dir, prompts, params, max_num_seqs=6)


def test_preemption_under_a_small_pool(model_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, engine = _same(model_dir, _prompts(12), params, max_num_seqs=8, num_kv_pages=40)
    assert engine.scheduler.num_preemptions > 0


def test_unforeseeable_stops_discard_the_queued_token(model_dir):
    prompts = _prompts(10)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain, _, _ = _run(model_dir, prompts, free, False, max_num_seqs=16)
    # a token and a piece of text that several outputs reach midway
    stop_token = plain[0][0][6]
    stop_text = plain[1][2].split()[4]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params.stop_token_ids = [stop_token]
    rows, _ = _same(model_dir, prompts, params, max_num_seqs=16)
    assert any(reason == "stop" for _, reason, _ in rows)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_text])
    rows, _ = _same(model_dir, prompts, params, max_num_seqs=16)
    assert any(reason == "stop" for _, reason, _ in rows)


def test_sampling_seeded_and_unseeded(model_dir):
    """Sampled rows pipeline too: seeded noise and min_tokens count the token in flight,
    and unseeded rows draw from their request's own derived seed."""
    prompts = _prompts(12)
    free = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True)
        for i in range(12)
    ]
    plain, _, _ = _run(model_dir, prompts, free, False, max_num_seqs=16, seed=5)
    stop_token = plain[2][0][5]
    seeded = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=i,
            max_tokens=16,
            min_tokens=4,
            ignore_eos=True,
            stop_token_ids=[stop_token],
        )
        for i in range(12)
    ]
    rows, _ = _same(model_dir, prompts, seeded, max_num_seqs=16, seed=5)
    assert any(reason == "stop" for _, reason, _ in rows)
    assert all(len(ids) >= 4 for ids, _, _ in rows)
    unseeded = [
        SamplingParams(temperature=1.0, top_k=50, max_tokens=3 + i, ignore_eos=True)
        for i in range(12)
    ]
    _same(model_dir, prompts, unseeded, max_num_seqs=16, seed=5)


def test_unseeded_sampling_with_early_stops(model_dir, engine_device):
    """Defaults (EOS on, no seeds): requests ending on a stop string or a stop id make
    the pipelined step compute a row it discards; no other row's draws may move. On the
    GPU with CUDA graphs too."""
    prompts = _prompts(12)
    free = SamplingParams(temperature=1.0, max_tokens=16)
    # a fixed pool: each engine's would otherwise be planned from the memory the ones
    # before it left free
    dev = dict(device=engine_device, num_kv_pages=512)
    plain, _, engine = _run(model_dir, prompts, free, False, max_num_seqs=16, seed=3, **dev)
    assert (engine.runner.graphs is not None) == (engine_device == "cuda")
    del engine
    stop_token = plain[0][0][4]
    stop_text = plain[1][2].split()[3]
    params = SamplingParams(
        temperature=1.0, max_tokens=16, stop=[stop_text], stop_token_ids=[stop_token]
    )
    rows, _ = _same(model_dir, prompts, params, max_num_seqs=16, seed=3, **dev)
    assert sum(reason == "stop" for _, reason, _ in rows) >= 2
    assert sum(len(ids) < 16 for ids, _, _ in rows) >= 2


def _length_mix(model_dir):
    """24 seeded requests ending by length after 2-8 tokens on six seats: the prompts,
    their params, plain stepping's rows and engine, and a pipelined LLM to run them on."""
    prompts = _prompts(24)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=2 + i % 7, ignore_eos=True)
        for i in range(24)
    ]
    plain, _, plain_engine = _run(model_dir, prompts, params, False, max_num_seqs=6)
    llm = LLM(model=str(model_dir), pipeline_decode=True, max_num_seqs=6, **KW)
    return prompts, params, plain, plain_engine, llm


def test_admitting_steps_launch_and_the_next_decode_queues_behind_them(model_dir):
    """A step that admits requests (prompt rows beside decode rows) is launched as well,
    and the decode step after it is built blind and queued while it runs: the same steps
    and outputs as plain stepping."""
    prompts, params, plain, plain_engine, llm = _length_mix(model_dir)
    runner = llm.engine.runner
    prompted, behind = [], []
    launch_step, launch_decode = runner.launch_step, runner.launch_decode

    def has_prompt(sched):
        return any(len(r.new_token_ids) > 1 for r in sched.requests)

    def step(sched, prev=None, *copies):
        prompted.append(has_prompt(sched))
        return launch_step(sched, prev, *copies)

    def decode(sched, prev=None, *copies):
        behind.append(prev is not None and has_prompt(prev.sched))
        return launch_decode(sched, prev, *copies)

    runner.launch_step, runner.launch_decode = step, decode
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    assert rows == plain
    assert llm.engine.stats.steps == plain_engine.stats.steps
    assert sum(prompted) >= 3, "no step that admits requests was launched"
    assert sum(behind) >= 3, "no decode step was queued behind an admitting step"
    assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_pages


def test_seats_freed_by_stops_are_admitted_while_a_step_runs(model_dir):
    """A seat that a stop id freed (a stop nobody could foresee) goes to a waiting
    request in a step scheduled and launched while the step before it runs, not in one
    scheduled after that step's tokens are back: the outputs of plain stepping."""
    prompts = _prompts(24)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain, _, _ = _run(model_dir, prompts, free, False, max_num_seqs=16)
    # the token most outputs reach midway
    common = Counter(t for ids, _, _ in plain for t in set(ids[2:])).most_common(1)[0][0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[common])
    plain, _, _ = _run(model_dir, prompts, params, False, max_num_seqs=6)
    assert sum(reason == "stop" for _, reason, _ in plain) >= 3
    llm = LLM(model=str(model_dir), pipeline_decode=True, max_num_seqs=6, **KW)
    ahead = count_launches_ahead(llm.engine.runner)
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    assert rows == plain
    assert ahead["with_prefill"] >= 2, "no admitting step was launched behind a running one"
    assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_pages


def test_seats_freed_by_length_are_admitted_while_a_step_runs(model_dir):
    """A request whose token in flight is its last by length leaves its seat before the
    token is back: a waiting request takes it in a step launched behind the one in
    flight, the same step as plain stepping admits it in (the same steps and outputs),
    and the runner is told once that the request left."""
    prompts, params, plain, plain_engine, llm = _length_mix(model_dir)
    runner = llm.engine.runner
    ahead = count_launches_ahead(runner)
    released = []
    apply = runner.apply

    def recorded(sched):
        released.extend(sched.released_ids)
        return apply(sched)

    runner.apply = recorded
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    assert rows == plain
    assert llm.engine.stats.steps == plain_engine.stats.steps
    assert ahead["with_prefill"] >= 3, "no admitting step was launched behind a running one"
    assert len(released) == len(set(released))
    assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_pages


def test_unseeded_draws_do_not_depend_on_the_batch(model_dir):
    """An unseeded request samples from the engine seed and its arrival index: other
    requests' lengths (what shares its steps) change nothing of its output."""
    prompts = _prompts(8)
    short = [SamplingParams(temperature=1.0, max_tokens=2 + 3 * i) for i in range(8)]
    long = [SamplingParams(temperature=1.0, max_tokens=20) for _ in range(8)]
    for i in (0, 5):
        short[i] = long[i]
    a, _, _ = _run(model_dir, prompts, short, True, max_num_seqs=16, seed=3)
    b, _, _ = _run(model_dir, prompts, long, True, max_num_seqs=16, seed=3)
    c, _, _ = _run(model_dir, prompts, long, True, max_num_seqs=16, seed=4)
    assert a[0] == b[0] and a[5] == b[5]
    assert b != c  # the engine seed still decides the unseeded draws


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_pipelined_match_plain_steps(model_dir):
    """On the GPU (bf16, Triton attention, decode graphs) with length limits only, the
    batches are the same step for step, so the outputs must be identical."""
    # a fixed pool: planned from free memory, a later engine could get a smaller one,
    # preempt, and batch differently
    gpu = dict(KW, device="cuda", dtype="bfloat16", attention_backend="triton", num_kv_pages=4096)
    prompts = _prompts(40)
    params = [
        SamplingParams(temperature=0, max_tokens=3 + i % 17, ignore_eos=True) for i in range(40)
    ]
    runs, steps = [], []
    for pipeline in (False, False, True):
        llm = LLM(model=str(model_dir), pipeline_decode=pipeline, max_num_seqs=16, **gpu)
        assert llm.engine.runner.graphs is not None
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        steps.append(llm.engine.stats.steps)
        assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_pages
        del llm
    differ = [i for i in range(len(prompts)) if runs[0][i] != runs[2][i]]
    assert runs[0] == runs[1], "plain steps are not deterministic run to run"
    assert steps[0] == steps[2]
    assert not differ, f"rows {differ}: {[(runs[0][i], runs[2][i]) for i in differ[:3]]}"
