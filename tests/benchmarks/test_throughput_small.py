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
    argv = ["--small", "--skip-peer", "--constant-ceilings", "--out", str(out), "--ckpt", str(ckpt)]
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
    # the roofline at the H200's constants (a GPU's bound for this workload, roofline.py)
    # is far beyond a CPU run
    assert result["ceilings"]["source"] == "H200 constants"
    roof = result["roofline_s"]
    assert result["fraction_at_h200_constants"] == pytest.approx(roof / ours["wall_s"])
    assert result["roofline_tok_s"] == pytest.approx(sum(out_lens) / roof)
    assert result["fraction_of_roofline"] == pytest.approx(roof / ours["wall_s"])
    assert 0 < result["fraction_of_roofline"] < 1


def test_the_roofline_is_the_measured_card_s_by_default(tmp_path):
    throughput = load("throughput")
    roofline = load("roofline")
    workloads = load("workloads")
    out = tmp_path / "out"
    argv = ["--small", "--skip-peer", "--out", str(out)]
    assert throughput.main([*argv, "--ckpt", str(tmp_path / "ckpt")]) == 0
    result = json.loads((out / "throughput.json").read_text())
    card = result["ceilings"]
    assert card["source"] == "measured"
    assert card["h2d_gb_s"] is None  # the CPU has no pinned copies to time
    prompts, out_lens = workloads.small_requests()
    want = roofline.roofline_seconds(
        workloads.SMALL_MODEL,
        [len(p) for p in prompts],
        out_lens,
        copy_bw=card["copy_bytes_per_s"],
        matmul_flops=card["matmul_flops"],
    )
    assert result["roofline_s"] == pytest.approx(want)
    assert result["fraction_of_roofline"] == pytest.approx(want / result["batchgen"]["wall_s"])
    # the CPU's ceilings are far below the H200's, so its roofline is far longer
    at_constants = roofline.roofline_seconds(
        workloads.SMALL_MODEL, [len(p) for p in prompts], out_lens
    )
    assert want > 10 * at_constants
    assert result["fraction_at_h200_constants"] == pytest.approx(
        at_constants / result["batchgen"]["wall_s"]
    )


def test_ceilings_fall_back_to_the_constants_with_a_warning(capsys):
    card = load("card")
    got = card.ceilings("no-such-device")
    assert got["source"] == "H200 constants"
    assert got["copy_bytes_per_s"] == card.COPY_BW and got["matmul_flops"] == card.MATMUL_FLOPS
    assert "not measured" in capsys.readouterr().err


def test_the_roofline_scales_with_the_ceilings():
    roofline = load("roofline")
    cfg = load("workloads").SMALL_MODEL
    base = roofline.roofline_seconds(cfg, [30, 50], [4, 8])
    twice = roofline.roofline_seconds(
        cfg,
        [30, 50],
        [4, 8],
        copy_bw=2 * roofline.COPY_BW,
        matmul_flops=2 * roofline.MATMUL_FLOPS,
    )
    assert twice == pytest.approx(base / 2)


def test_by_rows_buckets_the_decode_steps_against_the_roofline():
    """A made-up timeline of two requests (prompts 4 and 6 tokens, outputs 3 and 1): one
    prefill step, then decode steps at 2 rows, then 1; each bucket's wall is its steps'."""
    throughput = load("throughput")
    cfg = load("workloads").SMALL_MODEL
    prompts, out_lens = [[1] * 4, [1] * 6], [3, 1]
    # seconds, output tokens, computed tokens, running requests after the step
    timeline = [(0.010, 2, 10, 1), (0.013, 3, 11, 1), (0.017, 4, 12, 0)]
    table = throughput.by_rows(timeline, cfg, prompts, out_lens, 1e6, 1e14)
    assert table["prefill"]["steps"] == 1 and table["prefill"]["wall_s"] == 0.01
    (bucket,) = table["decode"]  # both decode steps ran with 1 row
    assert bucket["rows"] == 1 and bucket["steps"] == 2
    assert bucket["wall_ms"] == pytest.approx(3.5)
    # the roofline's 3 decode steps: 2 live rows at t=0, 1 at t=1 and t=2, all in bucket 1
    assert bucket["roof_steps"] == 3 and bucket["roof_ms"] > 0
    busy = {"rows": [2, 1, 1], "gpu_ms": [5.0, 1.0, 2.0]}
    table = throughput.by_rows(timeline, cfg, prompts, out_lens, 1e6, 1e14, busy)
    assert table["decode"][0]["gpu_ms"] == pytest.approx(8.0 / 3, abs=1e-3)
    assert "1+" in "\n".join(throughput.rows_lines(table))


def test_busy_run_reports_each_step_by_rows(tmp_path):
    throughput = load("throughput")
    out = tmp_path / "out"
    argv = ["--small", "--skip-peer", "--constant-ceilings", "--busy", "--out", str(out)]
    run_timed(throughput, argv + ["--ckpt", str(tmp_path / "ckpt")])
    result = json.loads((out / "throughput.json").read_text())
    busy = result["batchgen"]["busy"]
    assert len(busy["rows"]) == len(busy["wall_ms"]) == busy["steps"] > 0
    assert busy["gpu_ms"] == [None] * busy["steps"]  # the CPU: no events
    decode = result["by_rows"]["decode"]
    timed_steps = len(result["batchgen"]["timeline"])
    assert sum(b["steps"] for b in decode) + result["by_rows"]["prefill"]["steps"] == timed_steps
