"""benchmarks/hybrid.py --small: the W6 script end to end on the CPU (a tiny Kimi Linear
config, host tier on), peer included where this transformers has Kimi Linear."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


def test_small_run_writes_its_result(tmp_path):
    hybrid = load("hybrid")
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "config")]
    elapsed = run_timed(hybrid, argv)
    result = json.loads((out / "hybrid.json").read_text())
    ours, peer = result["batchgen"], result["peer"]
    ours_tok_s = rate_of(ours, 6 * 6, elapsed)
    assert ours["steps"] > 0 and 0 < ours["prefill_phase_s"] <= ours["wall_s"]
    if hybrid.peer_kda_path() is None:
        assert "no Kimi Linear" in peer["skipped"]
    else:
        # both timed runs ran one after the other inside the script's call
        assert ours["wall_s"] + peer["wall_s"] < elapsed
        assert result["ratio"] == pytest.approx(ours_tok_s / rate_of(peer, 6 * 6, elapsed))
        assert peer["peer_kda"] in ("fla-core", "torch")


def test_step_phases_give_a_row_of_host_times_per_step(tmp_path):
    """--step-phases: one row per step of the timed run in engine_runs.PHASES' columns;
    every step applied its tokens (update), and scheduling ran."""
    hybrid = load("hybrid")
    out = tmp_path / "out"
    argv = ["--small", "--skip-peer", "--step-phases", "--out", str(out)]
    assert hybrid.main(argv + ["--ckpt", str(tmp_path / "config")]) == 0
    ours = json.loads((out / "hybrid.json").read_text())["batchgen"]
    phases = ours["step_phases"]
    assert len(phases["rows"]) == ours["steps"]
    update, schedule = phases["columns"].index("update"), phases["columns"].index("schedule")
    assert all(row[update] > 0 for row in phases["rows"])
    assert sum(row[schedule] for row in phases["rows"]) > 0
