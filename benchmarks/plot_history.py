"""Draw benchmarks/history.tsv as history.svg: each workload's ratio to its peer (or
baseline) and batchgen's output tok/s, run by run, on log scales.

    python3 -m benchmarks.plot_history            # rewrites benchmarks/history.svg

history.tsv holds one row per recorded run that had its peer or baseline beside it
(HISTORY.md names each); add a row with each new result and run this again. The SVG is
written by hand (no plotting package needed), the same bytes for the same data.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

HERE = Path(__file__).parent
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WIDTH, PANEL_H, LEFT, RIGHT, TOP, GAP = 760, 250, 70, 150, 30, 60


def read_history(path: Path) -> list[dict]:
    """The rows of history.tsv (tab-separated), their numbers as floats."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for row in rows:
        for key in ("batchgen_tok_s", "baseline_tok_s", "ratio"):
            row[key] = float(row[key])
    return rows


def _ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks of a log axis spanning [lo, hi]."""
    out = []
    for exp in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**exp
            if lo <= v <= hi:
                out.append(v)
    return out


def _label(v: float) -> str:
    return f"{v:,.0f}" if v >= 1 else f"{v:g}"


def _panel(rows, key, title, top, x_of, workloads) -> list[str]:
    values = [r[key] for r in rows]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    plot_w = WIDTH - LEFT - RIGHT

    def y_of(v: float) -> float:
        return top + PANEL_H * (1 - (math.log10(v) - math.log10(lo)) / math.log10(hi / lo))

    out = [
        f'<text x="{LEFT}" y="{top - 10}" font-size="13" font-weight="bold">{title}</text>',
        f'<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{PANEL_H}" fill="none" '
        'stroke="#888"/>',
    ]
    for t in _ticks(lo, hi):
        y = y_of(t)
        out.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#eee"/>'
        )
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end">'
            f"{_label(t)}</text>"
        )
    for i, name in enumerate(workloads):
        pts = [(x_of[id(r)], y_of(r[key])) for r in rows if r["workload"] == name]
        colour = COLOURS[i % len(COLOURS)]
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}"/>')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in pts]
    return out


def draw(rows: list[dict]) -> str:
    """The SVG text: two panels over one run axis (dates below), a legend at the right."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    dates = sorted({r["date"] for r in rows})
    plot_w = WIDTH - LEFT - RIGHT
    slot = plot_w / len(dates)
    x_of = {}
    for d_i, date in enumerate(dates):
        same = [r for r in rows if r["date"] == date]
        for k, r in enumerate(same):  # runs of one date spread across its slot
            x_of[id(r)] = LEFT + slot * (d_i + (k + 1) / (len(same) + 1))
    height = TOP + 2 * PANEL_H + GAP + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        'font-family="sans-serif">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    out += _panel(rows, "ratio", "ratio to the peer or baseline (log)", TOP, x_of, workloads)
    bottom = TOP + PANEL_H + GAP
    out += _panel(rows, "batchgen_tok_s", "batchgen output tok/s (log)", bottom, x_of, workloads)
    axis_y = bottom + PANEL_H + 16
    for d_i, date in enumerate(dates):
        x = LEFT + slot * (d_i + 0.5)
        out.append(
            f'<text x="{x:.1f}" y="{axis_y}" font-size="10" text-anchor="middle">{date}</text>'
        )
    for i, name in enumerate(workloads):
        y = TOP + 10 + 18 * i
        colour = COLOURS[i % len(COLOURS)]
        out.append(f'<circle cx="{WIDTH - RIGHT + 20}" cy="{y}" r="4" fill="{colour}"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 30}" y="{y + 4}" font-size="11">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=HERE / "history.tsv")
    ap.add_argument("--out", type=Path, default=HERE / "history.svg")
    args = ap.parse_args(argv)
    args.out.write_text(draw(read_history(args.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
