"""benchmarks/host_pin.py on the CPU: the first-touch modes run and report; the modes
that pin with CUDA refuse clearly where there is no GPU."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load


def test_the_touch_modes_time_a_fresh_map_each(tmp_path, capsys):
    host_pin = load("host_pin")
    assert (
        host_pin.main(["--gib", "0.01", "--modes", "touch-1,touch-all", "--out", str(tmp_path)])
        == 0
    )
    summary = json.loads((tmp_path / "host_pin.json").read_text())
    assert [r["mode"] for r in summary["results"]] == ["touch-1", "touch-all"]
    assert all(r["seconds"] > 0 for r in summary["results"])
    assert summary["threads"] == torch.get_num_threads()  # touch-1 put the count back
    out = capsys.readouterr().out
    assert "touch-1" in out and "touch-all" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines with no GPU")
def test_the_cuda_modes_refuse_without_a_gpu(tmp_path):
    host_pin = load("host_pin")
    with pytest.raises(SystemExit, match="need a GPU"):
        host_pin.main(["--gib", "0.01", "--modes", "touch-1,batchgen", "--out", str(tmp_path)])
    assert not (tmp_path / "host_pin.json").exists()


def test_an_unknown_mode_is_a_usage_error(tmp_path, capsys):
    host_pin = load("host_pin")
    with pytest.raises(SystemExit) as exit_info:
        host_pin.main(["--modes", "touch-1,mlock", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown modes ['mlock']" in capsys.readouterr().err
