"""benchmarks/throughput.py --small: the W1 script end to end on the CPU (no peer)."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


def test_small_run_writes_its_result(tmp_path):
    throughput = load("throughput")
    small_requests = load("workloads").small_requests
    out = tmp_path / "out"
    ckpt = tmp_path / "ckpt"
    argv = ["--small", "--skip-peer", "--out", str(out), "--ckpt", str(ckpt)]
    elapsed = run_timed(throughput, argv)
    result = json.loads((out / "throughput.json").read_text())
    ours = result["batchgen"]
    _, out_lens = small_requests()
    rate_of(ours, sum(out_lens), elapsed)
    assert len(ours["timeline"]) >= max(out_lens)
    # the timeline's last step (seconds since the start to 4 places, tokens so far) ends
    # the timed run
    last_s, last_tokens = ours["timeline"][-1][:2]
    assert last_tokens == sum(out_lens) and 0 < last_s <= round(ours["wall_s"], 4)
    # the roofline (a GPU's bound for this workload, roofline.py) is far beyond a CPU run
    roof = result["roofline_s"]
    assert result["roofline_tok_s"] == pytest.approx(sum(out_lens) / roof)
    assert result["fraction_of_roofline"] == pytest.approx(roof / ours["wall_s"])
    assert 0 < result["fraction_of_roofline"] < 1
