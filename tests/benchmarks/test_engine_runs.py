"""engine_runs' engines are gone before the next one is built: timed_run's engine is
freed inside built_engine's exit, where the device cache is emptied."""

from __future__ import annotations

import gc
import types
import weakref

from bench_scripts import load


def test_timed_run_frees_its_engine_before_built_engine_collects(tmp_path, monkeypatch):
    engine_runs, workloads = load("engine_runs"), load("workloads")
    ckpt = workloads.config_dir(tmp_path / "model", workloads.SMALL_MODEL, "float32")
    refs, alive_at_collect = [], []

    def collect() -> int:  # built_engine's gc.collect(), just before it empties the cache
        found = gc.collect()
        alive_at_collect.extend(ref() is not None for ref in refs)
        return found

    monkeypatch.setattr(engine_runs, "gc", types.SimpleNamespace(collect=collect))
    result = engine_runs.timed_run(
        ckpt,
        [[5, 6, 7, 8]] * 3,
        [4, 3, 2],
        warmup_len=4,
        after=lambda llm: refs.append(weakref.ref(llm.engine)),
        dtype="float32",
        device="cpu",
        load_format="dummy",
        max_model_len=64,
    )
    assert result["output_tokens"] == 9
    assert alive_at_collect == [False]
