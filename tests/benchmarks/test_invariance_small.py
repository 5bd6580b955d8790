"""benchmarks/invariance.py: the deterministic=True probe on the CPU with --small (a tiny
Qwen3-shaped model): no row differs batched another way, through the host tier or across
reconfigure(), and a differing row is counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"), *extra]
    assert load("invariance").main(argv) == 0
    return json.loads((out / "invariance.json").read_text())


@pytest.mark.slow
def test_differently_batched_rows_are_identical_and_the_cost_is_measured(tmp_path):
    result = _run(tmp_path, "--requests", "8", "--runs", "batched,cost")
    assert result["engine"]["deterministic"] is True and result["requests"] == 8
    batched = result["batched"]
    assert batched["max_num_seqs"] == 3  # 3/8 of the 8 rows: other steps than the ample run's
    assert batched["rows_differing"] == 0 and result["rows_differing_total"] == 0
    cost = result["cost"]
    assert cost["deterministic_tok_per_s"] == result["ample"]["tok_per_s"]
    assert cost["plain_tok_per_s"] > 0 and "tier" not in result


@pytest.mark.slow
def test_tier_and_reconfigure_runs_swap_and_keep_every_row(tmp_path):
    result = _run(tmp_path, "--runs", "tier,reconfigure")
    assert result["tier"]["swaps_out"] > 0 and result["tier"]["rows_differing"] == 0
    again = result["reconfigure"]
    assert again["reconfigures"] > 0 and again["requests_preempted"] == 16
    assert again["rows_differing"] == 0


def test_a_row_with_another_token_or_ending_differs():
    differing = load("invariance").differing
    params = load("invariance").request_params(3, 4, greedy_only=False)
    ample = [([1, 2, 3], "length"), ([4, 5], "stop"), ([6], "stop")]
    rows = [([1, 2, 3], "length"), ([4, 9], "stop"), ([6], "length")]
    verdict = differing(rows, ample, params)
    assert verdict["rows_differing"] == 2 and verdict["rows"] == [1, 2]
    assert verdict["greedy_differing"] == 1 and verdict["sampled_differing"] == 1
    assert verdict["first_difference"] == [1, 1]
