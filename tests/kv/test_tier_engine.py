"""The host tier end to end on the CPU: swaps, host prefix hits and reconfigure()
must leave greedy outputs identical to an ample-pool run."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
BASE = dict(device="cpu", page_size=4, max_model_len=160, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return str(path)


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(3, 500) for _ in range(rng.randint(8, 30))] for _ in range(n)]


def _reference(model_dir, prompts, params=GREEDY):
    llm = LLM(model=model_dir, num_kv_pages=600, **BASE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _drive(llm, prompts, params=GREEDY, every=None, sizes=()):
    """Step the engine by hand; every `every` steps reconfigure() to the next size."""
    eng = llm.engine
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    reqs = dict(eng.requests)
    step, k = 0, 0
    while eng.has_unfinished:
        eng.step()
        step += 1
        if every and step % every == 0 and eng.has_unfinished:
            eng.reconfigure(sizes[k % len(sizes)])
            k += 1
    return [reqs[r].output_token_ids for r in ids], [reqs[r].num_preemptions for r in ids]


@pytest.mark.parametrize("decode_append", ["off", "batched", "layer"])
def test_every_request_swaps_twice_and_outputs_match(model_dir, decode_append):
    prompts = _prompts()
    llm = LLM(
        model=model_dir,
        num_kv_pages=40,
        host_kv_size_gib=0.02,
        decode_append=decode_append,
        batchgen_debug=True,
        **BASE,
    )
    outs, swaps = _drive(llm, prompts, every=5, sizes=[40])
    m = llm.engine.metrics()
    assert m["recomputes"] == 0
    assert min(swaps) >= 2, swaps
    assert m["swaps_out"] == m["swaps_in"] >= 2 * len(prompts)
    assert m["readback_checks"] > 0
    assert outs == _reference(model_dir, prompts)


def test_small_pool_swaps_instead_of_recomputing(model_dir):
    prompts = _prompts(10, seed=3)
    on = LLM(model=model_dir, num_kv_pages=40, host_kv_size_gib=0.02, **BASE)
    outs = [o.outputs[0].token_ids for o in on.generate(prompts, GREEDY, use_tqdm=False)]
    m = on.engine.metrics()
    assert m["swaps_out"] > 0 and m["recomputes"] == 0
    # traffic by reason adds up to the totals; swaps moved pages both ways, and nothing is
    # written through by default: pages reach the host only when evicted while wanted
    assert m["bytes_swap_out"] > 0 and m["bytes_swap_in"] > 0
    assert m.get("bytes_write_through", 0) == 0
    assert m["copy_seconds_swap_out"] > 0 and m["copy_seconds_swap_in"] > 0
    off = LLM(model=model_dir, num_kv_pages=40, **BASE)
    outs_off = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    assert off.engine.metrics()["recomputes"] > 0
    assert m["computed_tokens"] < off.engine.metrics()["computed_tokens"]
    assert outs == outs_off == _reference(model_dir, prompts)


def test_full_host_pool_falls_back_to_recompute(model_dir):
    prompts = _prompts(10, seed=3)
    tiny_host = 2 * 1 * 2 * 4 * 2 * 32 * 4 / 2**30  # a single host page
    llm = LLM(model=model_dir, num_kv_pages=40, host_kv_size_gib=tiny_host, **BASE)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.tier.host_pool.num_pages == 1
    assert llm.engine.metrics()["recomputes"] > 0
    assert outs == _reference(model_dir, prompts)


def _shared_prefix_batch():
    rng = random.Random(7)
    prefixes = [[rng.randint(3, 500) for _ in range(40)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randint(3, 500) for _ in range(6)] for i in range(16)]


def test_host_prefix_hits_cut_prefill_and_keep_outputs(model_dir):
    prompts = _shared_prefix_batch()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # arrival order evicts each prefix before its next use (prefix admission would group
    # the requests and leave the host nothing to serve)
    kw = dict(BASE, max_num_seqs=2, max_num_batched_tokens=64, admission="arrival")
    off = LLM(model=model_dir, num_kv_pages=42, **kw)
    on = LLM(model=model_dir, num_kv_pages=42, host_kv_size_gib=0.02, **kw)
    outs_off = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    outs_on = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    m_on, m_off = on.engine.metrics(), off.engine.metrics()
    assert m_on["host_prefix_hit_pages"] > 0
    assert m_on["bytes_prefix_load"] == m_on["host_prefix_hit_pages"] * on.engine.tier.page_bytes
    assert m_on["computed_tokens"] < m_off["computed_tokens"]
    assert outs_on == outs_off == _reference(model_dir, prompts, params)


def test_reconfigure_between_and_within_runs(model_dir):
    prompts = _prompts(8, seed=11)
    llm = LLM(model=model_dir, num_kv_pages=48, host_kv_size_gib=0.02, batchgen_debug=True, **BASE)
    outs, _ = _drive(llm, prompts, every=4, sizes=[64, 40, 56])
    assert outs == _reference(model_dir, prompts)
    # between generate calls: a new size, and host prefixes found again after it
    llm.engine.reconfigure(80)
    assert llm.engine.pool.num_pages == 80
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert again == outs
    assert llm.engine.metrics()["host_prefix_hit_pages"] > 0
