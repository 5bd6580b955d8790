"""benchmarks/mla.py --small: the W4 script end to end on the CPU, peer included."""

from __future__ import annotations

import json

from bench_scripts import load


def test_small_run_writes_its_result(tmp_path):
    mla = load("mla")
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "config")]
    assert mla.main(argv) == 0
    result = json.loads((out / "mla.json").read_text())
    ours, peer = result["batchgen"], result["peer"]
    assert ours["output_tokens"] == peer["output_tokens"] == 6 * 6
    assert ours["steps"] > 0 and 0 < ours["prefill_phase_s"] <= ours["wall_s"]
    assert result["ratio"] > 0
