"""benchmarks/host_overhead.py on the CPU: both measurements run and report the host's
share of each step apart from the model's forward."""

from __future__ import annotations

import json

from bench_scripts import load


def test_host_overhead_reports_both_measurements(tmp_path):
    bench = load("host_overhead")
    args = ["--requests", "48", "--w6-steps", "2", "--work", str(tmp_path), "--out", str(tmp_path)]
    assert bench.main(args) == 0
    result = json.loads((tmp_path / "host_overhead.json").read_text())
    many = result["many_requests"]
    assert many["requests"] == 48 and many["steps"] >= 8  # 8 output tokens each
    assert 0 < many["forward_s"] < many["wall_s"] and many["host_us_per_request"] > 0
    w6 = result["w6_steps"]
    assert w6["add_512_s"] > 0 and len(w6["steps_ms"]) == 2
    for row in w6["steps_ms"]:  # each step admits 32 prompts of 1024 and prepares them
        assert row["forward"] > 0 and row["schedule"] > 0 and row["prepare"] > 0
        assert 0 < row["host"]
    assert set(w6["median_after_first_ms"]) == {"schedule", "update", "prepare", "forward", "host"}
