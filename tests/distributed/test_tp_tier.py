"""The host KV tier at tensor_parallel_size=2 (this process rank 0, one spawned gloo
worker): a device pool too small for the batch forces swaps and host prefix hits, and
the outputs must equal a tier-off, ample-pool run at tensor_parallel_size=1; the worker
must really copy its own shard (its counters), and a worker that skips its copies must
show in the outputs."""

from __future__ import annotations

import random

import pytest
import tp_workers
from conftest import save_tiny_model

import batchgen.engine.builder_load as builder_load
from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", max_model_len=64, page_size=4, max_num_batched_tokens=24)
TIER = dict(tensor_parallel_size=2, num_kv_pages=18, host_kv_size_gib=0.001, **KW)
PARAMS = SamplingParams(temperature=0, max_tokens=16, logprobs=1)  # EOS may end a request


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    head = [rng.randint(3, 500) for _ in range(8)]  # two shared pages
    return [head + [rng.randint(3, 500) for _ in range(rng.randint(3, 10))] for _ in range(6)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_model(path, "LlamaForCausalLM")
    outs = LLM(path, num_kv_pages=200, **KW).generate(_prompts(), PARAMS, use_tqdm=False)
    return path, [_tokens_and_logprobs(o) for o in outs]


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def _run_twice(path: str, monkeypatch, **kw) -> tuple[list, dict, list]:
    """Both runs' outputs (the second finds the first's pages on host), rank 0's metrics
    (with `sent_<kind>`: the copies rank 0 handed the worker) and the worker's mirror
    counters."""
    sent = tp_workers.count_mirrored(monkeypatch)
    llm = LLM(path, **TIER, **kw)
    try:
        outs = [llm.generate(_prompts(), PARAMS, use_tqdm=False) for _ in range(2)]
        workers = llm.engine.tier_worker_metrics()
        m = llm.engine.metrics() | {f"sent_{k}": n for k, n in sent.items()}
        m["appends"] = llm.engine.tier.metrics.appends  # per-layer stores (decode_append)
        return outs, m, workers
    finally:
        llm.engine.shutdown()


def _max_logprob_error(outs, want) -> float:
    return max(
        abs(a - b)
        for run in outs
        for out, (_, ref) in zip(run, want)
        for a, b in zip(_tokens_and_logprobs(out)[1], ref)
    )


@pytest.mark.parametrize("debug", [False, True])
def test_tp2_host_tier_equals_tp1_ample_pool_and_the_worker_copies_its_shard(
    reference, debug, monkeypatch
):
    path, want = reference
    outs, m, (worker,) = _run_twice(path, monkeypatch, batchgen_debug=debug)
    for run in outs:
        assert [_tokens_and_logprobs(o)[0] for o in run] == [t for t, _ in want]
    assert _max_logprob_error(outs, want) < 1e-5
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0 and m["host_prefix_hit_pages"] > 0
    assert worker["pages_offloaded"] == m["pages_offloaded"] > 0
    assert worker["pages_loaded"] == m["pages_loaded"] > 0
    assert worker["loads"] == m["sent_load"] > 0 and worker["stores"] == m["sent_store"] > 0
    if debug:  # every offloaded page read back on both ranks, none differed
        assert worker["readback_checks"] == m["readback_checks"] == m["pages_offloaded"]
    else:
        assert worker["readback_checks"] == m["readback_checks"] == 0


@pytest.mark.parametrize("debug", [False, True])
def test_per_layer_decode_appends_at_two_ranks(reference, debug, monkeypatch):
    """decode_append="layer": rank 0 copies each layer of the pages a decode token fills
    right after writing it, and the worker does the same on its shard as its own forward
    runs (the plan travels with the step). The second call finds those pages on host on
    both ranks: the outputs stay the ample run's, and under batchgen_debug every layer of
    every such page is read back on both ranks."""
    path, want = reference
    outs, m, (worker,) = _run_twice(path, monkeypatch, decode_append="layer", batchgen_debug=debug)
    for run in outs:
        assert [_tokens_and_logprobs(o)[0] for o in run] == [t for t, _ in want]
    assert _max_logprob_error(outs, want) < 1e-5
    assert m["appends"] > 0 and worker["layer_stores"] == m["appends"]
    assert worker["pages_offloaded"] == m["pages_offloaded"] > 0
    assert worker["pages_loaded"] == m["pages_loaded"] > 0
    assert m["bytes_decode_append"] > 0
    if debug:
        assert worker["readback_checks"] == m["readback_checks"] > 0


def test_a_worker_skipping_its_tier_copies_changes_the_outputs(reference, monkeypatch):
    path, want = reference
    monkeypatch.setattr(builder_load, "worker_main", tp_workers.worker_main_skipping_tier_copies)
    outs, m, (worker,) = _run_twice(path, monkeypatch)
    assert m["pages_loaded"] > 0 and worker["loads"] == 0
    wrong_tokens = any(
        [_tokens_and_logprobs(o)[0] for o in run] != [t for t, _ in want] for run in outs
    )
    assert wrong_tokens or _max_logprob_error(outs, want) > 1e-3


def _step_with_reconfigures(llm, prompts, params, sizes: dict[int, int]) -> list[list[int]]:
    """Each prompt's tokens, the engine driven step by step; after step k the pool is
    re-created with sizes[k] pages (running requests swapped out first)."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done, steps = {}, 0
    while eng.has_unfinished:
        done.update((r.request_id, list(r.output_token_ids)) for r in eng.step())
        steps += 1
        if steps in sizes:
            eng.reconfigure(sizes[steps])
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_reconfigure_mid_run_at_two_ranks_keeps_the_outputs(reference):
    """The default configuration (pipelined decode, EOS endings): the pool grows, then
    shrinks back, while requests run; a worker that kept its old pool would index past
    it after the growth."""
    path, _ = reference
    params = SamplingParams(temperature=0, max_tokens=16)
    ample = LLM(path, num_kv_pages=200, **KW).generate(_prompts(), params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in ample]
    llm = LLM(path, **TIER)
    try:
        got = _step_with_reconfigures(llm, _prompts(), params, {3: 26, 9: 18})
        (worker,) = llm.engine.tier_worker_metrics()
        m = llm.engine.metrics()
        assert llm.engine.pool.num_pages == 18
    finally:
        llm.engine.shutdown()
    assert got == want
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0
    assert worker["pages_offloaded"] == m["pages_offloaded"] > 0


def test_a_worker_that_cannot_allocate_sends_every_rank_back(reference, monkeypatch):
    path, _ = reference
    monkeypatch.setattr(builder_load, "worker_main", tp_workers.worker_main_failing_a_pool)
    params = SamplingParams(temperature=0, max_tokens=16)
    ample = LLM(path, num_kv_pages=200, **KW).generate(_prompts(), params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in ample]
    llm = LLM(path, **TIER)
    try:
        with pytest.raises(RuntimeError, match=r"reconfigure\(29\).*rank 1: out of memory"):
            llm.engine.reconfigure(tp_workers.FAILING_POOL_PAGES)
        assert llm.engine.pool.num_pages == 18
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == want  # both ranks run on pools of the old size
