"""benchmarks/graph_replay.py on a machine without a GPU: a clear refusal, nothing built."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines with no GPU")
def test_graph_replay_refuses_without_a_gpu(tmp_path):
    graph_replay = load("graph_replay")
    with pytest.raises(SystemExit, match="needs a GPU"):
        graph_replay.main(["--out", str(tmp_path)])
    assert not (tmp_path / "graph_replay.json").exists()


def test_probes_keep_repeats_and_refuse_unknown_names(capsys):
    graph_replay = load("graph_replay")
    assert graph_replay.parse_probes("stream, stream,pin,") == ["stream", "stream", "pin"]
    with pytest.raises(SystemExit) as exit_info:
        graph_replay.main(["--probes", "stream,teleport"])
    assert exit_info.value.code == 2  # argparse's usage error, before any engine is built
    assert "unknown probes ['teleport']" in capsys.readouterr().err


def test_probes_include_the_control_and_the_capture_stream():
    graph_replay = load("graph_replay")
    assert graph_replay.parse_probes("none,capture,stream") == ["none", "capture", "stream"]


def test_each_runs_every_probe_in_a_process_of_its_own(tmp_path, monkeypatch, capsys):
    """--each: one child a probe, `none` before and after it, and the change per probe
    read from each child's graph_replay.json (the children faked: no GPU here)."""
    import json
    import subprocess
    import types
    from pathlib import Path

    graph_replay = load("graph_replay")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        slow = 0.17 if "stream" in cmd[cmd.index("--probes") + 1] else 0.0
        clocks = {"sm_mhz": 1980, "sm_mhz_min": 1965, "mem_mhz": 3201, "watts": 450.5}
        clocks["reasons"] = "0x0"
        rows = [
            {"capture": 0, "replay_ms": {"32": 5.94}},
            {"probe": "none", "replay_ms": {"32": 5.94}, "clocks": clocks},
            {"probe": "x", "replay_ms": {"32": 5.94 + slow}},
            {"probe": "none", "replay_ms": {"32": 5.94 + slow}, "clocks": clocks},
        ]
        (out / "graph_replay.json").write_text(json.dumps(rows))
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--each", "--probes", "pin,stream", "--buckets", "32", "--out", str(tmp_path)]
    assert graph_replay.main(argv) == 0
    assert [c[c.index("--probes") + 1] for c in calls] == ["none,pin,none", "none,stream,none"]
    table = json.loads((tmp_path / "graph_replay_each.json").read_text())
    assert table["pin"]["32"] == 0.0 and abs(table["stream"]["32"] - 0.17) < 1e-9
    out = capsys.readouterr().out
    assert "stream: bs 32: 5.940 -> 6.110 ms; SM 1980 (min 1965) MHz, mem 3201, 450.5 W" in out


def test_clock_sampler_summarises_its_samples_and_is_empty_without_nvml():
    graph_replay = load("graph_replay")
    sampler = graph_replay.ClockSampler()
    sampler._nvml = None  # as where NVML is missing: no thread, nothing read
    with sampler:
        pass
    assert sampler.summary() == {}
    sampler.samples = [(1980, 3201, 500.0), (1935, 3201, 560.0), (1965, 3201, 540.0)]
    sampler.reasons = 0x4
    got = sampler.summary()
    assert (got["sm_mhz"], got["sm_mhz_min"], got["watts"], got["reasons"]) == (
        1965,
        1935,
        540.0,
        "0x4",
    )
