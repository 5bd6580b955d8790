"""benchmarks/stream_gaps.py on a machine without a GPU: clear refusals, nothing written."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines with no GPU")
def test_stream_gaps_refuses_without_a_gpu(tmp_path):
    stream_gaps = load("stream_gaps")
    with pytest.raises(SystemExit, match="needs a GPU"):
        stream_gaps.main(["--out", str(tmp_path)])
    assert not (tmp_path / "stream_gaps.json").exists()


def test_an_unknown_scenario_is_a_usage_error(capsys, tmp_path):
    stream_gaps = load("stream_gaps")
    with pytest.raises(SystemExit) as exit_info:
        stream_gaps.main(["--scenarios", "none,three-streams", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown scenarios ['three-streams']" in capsys.readouterr().err
    assert not (tmp_path / "stream_gaps.json").exists()
