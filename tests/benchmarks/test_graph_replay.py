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
