"""A run adds its requests and runs its steps inside engine.memory.fewer_full_collections:
Python's full cyclic collections (a walk of the whole heap) are rarer there, the youngest
generation collected after more allocations, and the thresholds are restored when the run ends, also
when a step fails."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.api.batch_job import JobOptions, run_batch_job
from batchgen.engine.memory import (
    RUN_FULL_COLLECTION_THRESHOLD,
    RUN_YOUNG_COLLECTION_THRESHOLD,
    fewer_full_collections,
)

RUN = (RUN_YOUNG_COLLECTION_THRESHOLD, 10, RUN_FULL_COLLECTION_THRESHOLD)


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # freed only by the cyclic collector


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "LlamaForCausalLM")
    return LLM(str(path), device="cpu", dtype="float32", num_kv_pages=64, max_model_len=64)


@pytest.fixture(autouse=True)
def _default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults
    yield
    gc.set_threshold(*saved)


def _watch_steps(monkeypatch, engine, seen: list, on_first=None) -> None:
    step = engine.step

    def watched():
        seen.append(gc.get_threshold())
        if on_first is not None and len(seen) == 1:
            on_first()
        return step()

    monkeypatch.setattr(engine, "step", watched)


def test_generate_runs_with_rare_full_collections_and_restores_them(monkeypatch, llm):
    seen: list = []
    _watch_steps(monkeypatch, llm.engine, seen)
    out = llm.generate(["w1 w2 w3", "w4"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out) == 2 and all(o.outputs[0].token_ids for o in out)
    assert seen and set(seen) == {RUN}
    assert gc.get_threshold() == (700, 10, 10)


def test_a_cycle_dropped_mid_run_stays_collectable(monkeypatch, llm):
    """Nothing is frozen or held: a reference cycle that was alive when the run began
    and is dropped at its first step is freed by the next full collection (a freeze of
    the heap at the start of a run would keep it, and an old engine's memory with it)."""
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    holder = [garbage]
    del garbage
    gc.collect()  # the cycle now sits in the oldest generation, alive
    seen: list = []
    _watch_steps(monkeypatch, llm.engine, seen, on_first=holder.clear)
    llm.generate(["w1 w2"], SamplingParams(temperature=0, max_tokens=2))
    assert seen
    gc.collect()
    assert ref() is None


def test_a_higher_threshold_of_the_caller_is_kept(monkeypatch, llm):
    gc.set_threshold(50_000, 10, 1000)
    seen: list = []
    _watch_steps(monkeypatch, llm.engine, seen)
    llm.generate(["w1 w2"], SamplingParams(temperature=0, max_tokens=2))
    assert seen and set(seen) == {(50_000, 10, 1000)}  # raised, never lowered
    assert gc.get_threshold() == (50_000, 10, 1000)


def test_thresholds_are_restored_when_a_step_fails(monkeypatch, llm):
    def broken():
        assert gc.get_threshold() == RUN
        raise RuntimeError("step failed")

    monkeypatch.setattr(llm.engine, "step", broken)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate(["w1"], SamplingParams(temperature=0, max_tokens=2))
    assert gc.get_threshold() == (700, 10, 10)
    assert not llm.engine.has_unfinished  # the failed call's requests were aborted


def test_batch_job_runs_with_rare_full_collections(monkeypatch, tmp_path, llm):
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"w{i} w{i + 1}", "max_tokens": 2, "temperature": 0},
        }
        for i in range(3)
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: list = []
    _watch_steps(monkeypatch, llm.engine, seen)
    opts = JobOptions(input=inp, output=tmp_path / "out.jsonl", model_name="tiny", progress=False)
    summary = run_batch_job(llm, opts)
    assert summary.failed == 0 and len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    assert seen and set(seen) == {RUN}
    assert gc.get_threshold() == (700, 10, 10)


def test_nested_runs_restore_the_outer_thresholds():
    with fewer_full_collections():
        outer = gc.get_threshold()
        with fewer_full_collections():
            assert gc.get_threshold() == outer
        assert gc.get_threshold() == outer
    assert gc.get_threshold() == (700, 10, 10)
