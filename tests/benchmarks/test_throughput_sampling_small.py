"""benchmarks/throughput.py --small --sampling: greedy and each sampled configuration in
one process on the CPU, each run's rate and its ratio to greedy."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


def test_sampling_runs_beside_greedy(tmp_path):
    throughput = load("throughput")
    _, out_lens = load("workloads").small_requests()
    out = tmp_path / "out"
    argv = ["--small", "--sampling", "all", "--out", str(out), "--ckpt", str(tmp_path / "c")]
    elapsed = run_timed(throughput, argv)
    runs = json.loads((out / "sampling.json").read_text())["sampling"]
    assert list(runs) == ["greedy", "sampled", "top_k", "penalty"]
    rates = {name: rate_of(run, sum(out_lens), elapsed) for name, run in runs.items()}
    assert sum(run["wall_s"] for run in runs.values()) < elapsed
    for name, run in runs.items():
        assert run["ratio_to_greedy"] == pytest.approx(rates[name] / rates["greedy"])
    assert not (out / "throughput.json").exists()  # the default run did not run
