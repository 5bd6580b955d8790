"""python -m benchmarks NAME: each workload name runs its module's main() with the
options that make it the workload, then the caller's."""

from __future__ import annotations

from bench_scripts import load


def test_a_workload_name_runs_its_module_with_its_options_first(monkeypatch):
    entry = load("__main__")
    throughput = load("throughput")
    seen = []
    monkeypatch.setattr(throughput, "main", lambda argv: seen.append(argv) or 0)
    assert entry.main(["w1-sampled", "--small", "--out", "d"]) == 0
    assert entry.main(["w1", "--skip-peer"]) == 0
    assert seen == [["--sampling", "all", "--small", "--out", "d"], ["--skip-peer"]]


def test_every_name_names_a_module_with_a_main_and_an_unknown_name_fails():
    entry = load("__main__")
    for module, _options, _what in entry.WORKLOADS.values():
        assert callable(load(module).main), module
    assert entry.main(["w9"]) == 2 and entry.main([]) == 0
