"""benchmarks/tp_scaling.py --small: W5's script end to end on the CPU, TP=1 and TP=2
(two gloo ranks) each in a process of its own."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


@pytest.mark.slow
def test_small_run_times_both_sizes_in_their_own_processes(tmp_path):
    tp_scaling = load("tp_scaling")
    workloads = load("workloads")
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "config")]
    elapsed = run_timed(tp_scaling, argv)
    result = json.loads((out / "tp_scaling.json").read_text())
    want_tokens = sum(workloads.small_requests(16)[1])
    tok_s = {}
    for size in (1, 2):
        run = result["runs"][str(size)]
        assert run["tensor_parallel_size"] == size
        assert run["all_outputs"] and not run["cuda_graphs"]  # the CPU captures none
        tok_s[size] = rate_of(run, want_tokens, elapsed)
    # the two processes ran one after the other inside the script's call
    assert result["runs"]["1"]["wall_s"] + result["runs"]["2"]["wall_s"] < elapsed
    assert result["tp"] == 2 and result["speedup"] == pytest.approx(tok_s[2] / tok_s[1])


def test_a_size_below_two_is_a_usage_error(tmp_path, capsys):
    tp_scaling = load("tp_scaling")
    with pytest.raises(SystemExit) as exit_:
        tp_scaling.main(["--small", "--tp", "1", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--tp must be 2 or more" in capsys.readouterr().err
