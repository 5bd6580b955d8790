"""benchmarks/plot_history.py and the history.tsv it draws."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load

HISTORY = Path(load("plot_history").__file__).parent / "history.tsv"


def test_each_recorded_ratio_is_its_two_figures_divided():
    rows = load("plot_history").read_history(HISTORY)
    assert len(rows) > 10
    for row in rows:
        want = row["batchgen_tok_s"] / row["baseline_tok_s"]
        assert row["ratio"] == pytest.approx(want, rel=0.01), row


def test_the_svg_has_a_point_a_run_in_each_panel_and_a_legend_entry_a_workload(tmp_path):
    plot = load("plot_history")
    data = tmp_path / "h.tsv"
    data.write_text(
        "date\tworkload\tcard\tcommit\tbatchgen_tok_s\tbaseline_tok_s\tratio\tbaseline\n"
        "2026-01-01\tWa\tH200\tabc\t1000\t100\t10\tpeer\n"
        "2026-01-01\tWb\tH200\tabc\t2000\t2000\t1\toff\n"
        "2026-01-02\tWa\tH100\tdef\t3000\t100\t30\tpeer\n"
    )
    out = tmp_path / "h.svg"
    assert plot.main(["--data", str(data), "--out", str(out)]) == 0
    svg = out.read_text()
    assert svg.count("<circle") == 2 * 3 + 2  # two panels of three runs, two legend dots
    assert svg.count("<polyline") == 2  # Wa's two runs joined in each panel
    assert ">Wa</text>" in svg and ">Wb</text>" in svg and ">2026-01-02</text>" in svg
