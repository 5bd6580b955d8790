"""Async scheduling (EngineConfig.async_scheduling): every step, prefill chunks included,
is scheduled and launched while the one before runs, a request's token in flight read
on the device. The outputs are those of plain stepping: length limits, unforeseeable
stops (stop ids, stop strings, EOS) whose extra token is discarded, admission, preemption
(recomputed, or swapped by the host tier), seeded and unseeded sampling; and a request
that needs its tokens on the host each step (logprobs) makes the steps synchronous while
it runs. Nothing is left held afterwards."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import count_launches_ahead, save_tiny_model

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def _prompts(n: int, longest: int = 30) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randint(3, 500) for _ in range(rng.randint(2, longest))] for _ in range(n)]


def _run(model_dir, prompts, params, async_: bool, **kw):
    """Outputs (ids, finish reason, text) of a run, the launches that followed a step in
    flight and, of those, the ones with a prefill chunk; the engine, checked empty."""
    llm = LLM(model=str(model_dir), pipeline_decode=async_, async_scheduling=async_, **{**KW, **kw})
    ahead = count_launches_ahead(llm.engine.runner)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished and not engine.requests
    assert engine.kv.num_free_pages == engine.kv.allocator.num_pages
    assert all(not r.num_pending for r in engine.scheduler.running)
    rows = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    return rows, ahead, engine


def _same(model_dir, prompts, params, **kw):
    plain, ahead, _ = _run(model_dir, prompts, params, False, **kw)
    assert ahead["steps"] == 0
    rows, ahead, engine = _run(model_dir, prompts, params, True, **kw)
    assert ahead["steps"] > 0, "no step was launched ahead"
    assert ahead["with_prefill"] > 0, "no prefill chunk was launched ahead"
    assert rows == plain
    return rows, engine


def test_defaults_with_eos_and_stops(model_dir):
    """The first row of the matrix: EOS on, stop ids and stop strings that several
    outputs reach midway, greedy."""
    prompts = _prompts(16)
    free = SamplingParams(temperature=0, max_tokens=20)
    plain, _, _ = _run(model_dir, prompts, free, False, max_num_seqs=6)
    stop_token = plain[0][0][6]
    stop_text = plain[1][2].split()[4]
    params = SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_token], stop=[stop_text]
    )
    rows, engine = _same(model_dir, prompts, params, max_num_seqs=6)
    assert sum(reason == "stop" for _, reason, _ in rows) >= 2
    # the steps' counters match what was computed: nothing of a discarded token stays
    computed = engine.scheduler.num_computed_tokens_total
    assert computed >= sum(len(p) for p in prompts)


def test_length_limits_and_admission(model_dir):
    prompts = _prompts(20)
    params = [
        SamplingParams(temperature=0, max_tokens=1 + i % 9, ignore_eos=True) for i in range(20)
    ]
    _same(model_dir, prompts, params, max_num_seqs=6)


def test_long_prompts_in_chunks(model_dir):
    """Prompts longer than a step's budget: chunks follow each other in flight."""
    prompts = _prompts(6, longest=80)
    params = SamplingParams(temperature=0, max_tokens=6)
    _same(model_dir, prompts, params, max_num_seqs=4, max_num_batched_tokens=16)


def test_preemption_recomputed(model_dir):
    params = SamplingParams(temperature=0, max_tokens=24)
    _, engine = _same(model_dir, _prompts(12), params, max_num_seqs=8, num_kv_pages=40)
    assert engine.scheduler.num_preemptions > 0


def test_preemption_swapped_by_the_host_tier(model_dir):
    params = SamplingParams(temperature=0, max_tokens=24)
    tier = dict(num_kv_pages=40, host_kv_size_gib=0.01, tier_policy="always")
    _, engine = _same(model_dir, _prompts(12), params, max_num_seqs=8, **tier)
    assert engine.scheduler.num_preemptions > 0
    assert engine.tier.metrics.swaps_out > 0


def test_sampling_seeded_and_unseeded(model_dir):
    """Seeded noise and min_tokens count the token in flight; unseeded rows draw from
    their request's own derived seed."""
    prompts = _prompts(12)
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, min_tokens=4)
        for i in range(12)
    ]
    rows, _ = _same(model_dir, prompts, seeded, max_num_seqs=5, seed=5)
    assert all(len(ids) >= 4 for ids, _, _ in rows)
    unseeded = [SamplingParams(temperature=1.0, top_k=50, max_tokens=3 + i) for i in range(12)]
    _same(model_dir, prompts, unseeded, max_num_seqs=5, seed=5)


def test_a_request_with_prompt_logprobs_makes_steps_synchronous(model_dir):
    """While a request asks for prompt logprobs (which only a plain step computes) its
    steps run as before (its outputs and the others' unchanged); once it is done, steps
    are launched ahead again. Logprobs of sampled tokens no longer do this: they come
    back with the tokens."""
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i) for i in range(10)]
    params[0] = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    plain, _, _ = _run(model_dir, prompts, params, False, max_num_seqs=4)
    rows, ahead, _ = _run(model_dir, prompts, params, True, max_num_seqs=4)
    assert rows == plain
    assert ahead["steps"] > 0


def test_not_used_where_it_cannot_run(model_dir):
    """Off with pipeline_decode=False or batchgen_debug: every step is plain."""
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, max_tokens=5)
    for kw in (dict(pipeline_decode=False), dict(batchgen_debug=True)):
        llm = LLM(model=str(model_dir), async_scheduling=True, **{**KW, **kw})
        assert llm.engine.overlap.name != "async"
        llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_with_graphs_it_matches_plain_steps(model_dir):
    """bf16, Triton attention, decode graphs. Every request is admitted in the first
    step and ends by length, so the steps hold the same rows either way and the outputs
    must be identical; then the defaults (EOS on, a stop string) finish every request
    and leave every page free."""
    gpu = dict(KW, device="cuda", dtype="bfloat16", attention_backend="triton", num_kv_pages=4096)
    gpu.update(max_num_batched_tokens=2048, max_num_seqs=64)
    prompts = _prompts(40)
    by_length = dict(temperature=0, ignore_eos=True)  # off-defaults: the first half only
    params = [SamplingParams(max_tokens=3 + i % 17, **by_length) for i in range(40)]
    runs, texts = [], []
    for async_ in (False, True):
        llm = LLM(model=str(model_dir), async_scheduling=async_, **gpu)
        used = llm.engine.overlap.name == "async"
        assert llm.engine.runner.graphs is not None and used == async_
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        texts.append([o.outputs[0].text for o in outs])
        del llm
    differ = [i for i in range(len(prompts)) if runs[0][i] != runs[1][i]]
    assert not differ, f"rows {differ}: {[(runs[0][i], runs[1][i]) for i in differ[:3]]}"
    stop_text = next(t.split()[1] for t in texts[0] if len(t.split()) > 2)
    llm = LLM(model=str(model_dir), async_scheduling=True, **gpu)
    defaults = SamplingParams(temperature=0, max_tokens=20, stop=[stop_text])
    outs = llm.generate(prompts, defaults, use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_pages
