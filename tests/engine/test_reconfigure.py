"""EngineCore.reconfigure(): validated before anything changes, the old pool released
before the new one is allocated, and never left without a pool when allocation fails."""

from __future__ import annotations

import weakref

import pytest
from conftest import save_tiny_model
from eager_graphs import install_eager_graphs

from batchgen import LLM, SamplingParams
from batchgen.engine import memory  # reconfigure() makes its pools there (remake_pool)

KW = dict(device="cpu", page_size=4, max_model_len=64, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [[5 + i, 9, 30 + i, 7, 8, 100 + i, 3, 4, 50] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("reconf")
    save_tiny_model(path, "LlamaForCausalLM")
    return str(path)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _watch_release(engine, monkeypatch) -> list[bool]:
    """For each pool reconfigure() makes from now on, whether the engine's current pool
    was gone by then: its tensor and every layer cache (views of it: a view keeps the
    pool's memory alive without its tensor), by weak reference."""
    caches = [t for layer in engine.runner.kv_caches for t in layer]
    old = [weakref.ref(engine.pool.kv)] + [weakref.ref(t) for t in caches]
    seen = []
    real = memory.PagePool

    def watching(*args, **kw):
        seen.append(all(ref() is None for ref in old))
        return real(*args, **kw)

    monkeypatch.setattr(memory, "PagePool", watching)
    return seen


def test_too_small_a_pool_is_refused_before_anything_changes(model_dir):
    llm = LLM(model=model_dir, num_kv_pages=40, host_kv_size_gib=0.01, **KW)
    eng = llm.engine
    for rid, p in zip("abc", PROMPTS):
        eng.add_request(rid, p, GREEDY)
    eng.step()
    running = list(eng.scheduler.running)
    for bad in (15, 0, 2.5):  # 15 pages hold 60 tokens < max_model_len 64
        with pytest.raises(ValueError, match="max_model_len"):
            eng.reconfigure(bad)
    assert eng.pool.num_pages == 40 and eng.scheduler.running == running


def test_the_old_pool_is_released_before_the_new_one_is_allocated(model_dir, monkeypatch):
    llm = LLM(model=model_dir, num_kv_pages=40, host_kv_size_gib=0.01, **KW)
    ref = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.engine.metrics()["kv_pages"] == 40  # the device pool's pages
    seen = _watch_release(llm.engine, monkeypatch)
    llm.engine.reconfigure(48)
    assert seen == [True], "the old KV tensor was still referenced when the new pool was made"
    assert llm.engine.pool.num_pages == 48 and llm.engine.metrics()["kv_pages"] == 48
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref


def test_a_failed_allocation_restores_a_pool_of_the_old_size(model_dir, monkeypatch):
    llm = LLM(model=model_dir, num_kv_pages=40, host_kv_size_gib=0.01, **KW)
    ref = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    eng = llm.engine
    for rid, p in zip("abc", PROMPTS):
        eng.add_request(rid, p, GREEDY)
    eng.step()
    real = memory.PagePool

    def failing(layout, num_pages, device):
        if num_pages == 4096:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(layout, num_pages, device)

    monkeypatch.setattr(memory, "PagePool", failing)
    with pytest.raises(RuntimeError, match="previous 40 pages"):
        eng.reconfigure(4096)
    assert eng.pool.num_pages == 40 and eng.kv.allocator.num_pages == 40
    while eng.has_unfinished:  # the requests caught in it finish, as do new ones
        eng.step()
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref


def test_decode_graphs_let_go_of_the_old_pool_their_sampling_tails_were_captured_over(
    model_dir, monkeypatch
):
    """A GPU engine that sampled has captured sampling tails, and its DecodeGraphs keep
    the layer caches those were captured over (set as `capture_tail` sets it; tails need
    CUDA). reconfigure() must still free the old pool before it makes the new one: on an
    H100 the invariance probe's reconfigure of a 69 GiB pool ran out of memory beside the
    old one when the graphs kept it."""
    run = dict(KW, dtype="float32", max_num_seqs=4)
    llm = LLM(model=model_dir, num_kv_pages=40, attention_backend="triton", **run)
    install_eager_graphs(llm, run)
    ref = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    graphs = llm.engine.runner.graphs
    graphs._tail_kv = graphs.kv_caches  # what capturing a sampling tail records
    seen = _watch_release(llm.engine, monkeypatch)
    llm.engine.reconfigure(48)
    assert seen == [True], "the decode graphs still held the old KV pool when the new was made"
    install_eager_graphs(llm, run)  # graphs over the new pool (a GPU captures them again)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref
