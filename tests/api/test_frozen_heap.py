"""A run leaves the heap that exists when it starts to Python's cyclic collector only at
its end (engine.memory.frozen_heap): frozen while requests are added and steps run, then
collectable again, so what the caller drops during or after a run is still freed."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.api.batch_job import JobOptions, run_batch_job
from batchgen.engine.memory import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # freed only by the cyclic collector


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "LlamaForCausalLM")
    return LLM(str(path), device="cpu", dtype="float32", num_kv_pages=64, max_model_len=64)


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _watch_steps(monkeypatch, engine, seen: list[int], on_first=None) -> None:
    step = engine.step

    def watched():
        seen.append(gc.get_freeze_count())
        if on_first is not None and len(seen) == 1:
            on_first()
        return step()

    monkeypatch.setattr(engine, "step", watched)


def test_generate_runs_frozen_and_thaws_what_it_froze(monkeypatch, llm):
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    holder = [garbage]
    del garbage
    seen: list[int] = []
    _watch_steps(monkeypatch, llm.engine, seen, on_first=holder.clear)  # garbage mid-run
    out = llm.generate(["w1 w2 w3", "w4"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out) == 2 and all(o.outputs[0].token_ids for o in out)
    assert seen and min(seen) > 0  # every step ran with the heap frozen
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # frozen during the run, collected after it


def test_generate_keeps_a_callers_frozen_heap_frozen(monkeypatch, llm):
    gc.freeze()
    before = gc.get_freeze_count()
    seen: list[int] = []
    _watch_steps(monkeypatch, llm.engine, seen)
    llm.generate(["w1 w2"], SamplingParams(temperature=0, max_tokens=2))
    assert seen and min(seen) >= before
    assert gc.get_freeze_count() >= before > 0


def test_generate_thaws_when_a_step_fails(monkeypatch, llm):
    def broken():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("step failed")

    monkeypatch.setattr(llm.engine, "step", broken)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate(["w1"], SamplingParams(temperature=0, max_tokens=2))
    assert gc.get_freeze_count() == 0
    assert not llm.engine.has_unfinished  # the failed call's requests were aborted


def test_batch_job_runs_frozen_and_thaws(monkeypatch, tmp_path, llm):
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
    seen: list[int] = []
    _watch_steps(monkeypatch, llm.engine, seen)
    opts = JobOptions(input=inp, output=tmp_path / "out.jsonl", model_name="tiny", progress=False)
    summary = run_batch_job(llm, opts)
    assert summary.failed == 0 and len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0


def test_frozen_heap_nests_without_thawing_the_outer_freeze():
    with frozen_heap():
        outer = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() >= outer > 0
        assert gc.get_freeze_count() >= outer  # the inner one found it frozen: left so
    assert gc.get_freeze_count() == 0
