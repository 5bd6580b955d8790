"""Accuracy with a 95% interval, per-subject tables, agreement between two runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% by default).

    Unlike the normal approximation it stays inside [0, 1] and is sensible at 0 or n
    successes. With no trials it is the whole of [0, 1].
    """
    if total < 0 or not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total, got {correct} of {total}")
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    z2 = z * z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int

    @property
    def rate(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.correct, self.total)

    def describe(self) -> str:
        lo, hi = self.interval
        return f"{self.rate:.3f} [{lo:.3f}, {hi:.3f}] ({self.correct}/{self.total})"

    def as_dict(self) -> dict:
        lo, hi = self.interval
        return {
            "correct": self.correct,
            "total": self.total,
            "accuracy": self.rate,
            "ci95": [lo, hi],
        }


def accuracy(results: Sequence) -> Accuracy:
    """Results have a boolean `correct`."""
    return Accuracy(sum(1 for r in results if r.correct), len(results))


def by_subject(results: Sequence) -> dict[str, Accuracy]:
    """Accuracy per subject (results have `subject` and `correct`), subjects sorted;
    questions without a subject are grouped under "(none)"."""
    groups: dict[str, list] = {}
    for r in results:
        groups.setdefault(r.subject if r.subject is not None else "(none)", []).append(r)
    return {name: accuracy(groups[name]) for name in sorted(groups)}


def agreement(ours: Sequence, theirs: Sequence) -> Accuracy:
    """How many questions two runs answer the same (`predicted`, None included)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} results against {len(theirs)}")
    same = sum(1 for a, b in zip(ours, theirs) if a.predicted == b.predicted)
    return Accuracy(same, len(ours))


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)]) + "\n"


def subject_table(runs: dict[str, Sequence]) -> str:
    """One row per subject, one "accuracy [95% CI]" column per named run, plus "all"."""
    names = list(runs)
    tables = {name: by_subject(results) for name, results in runs.items()}
    subjects = list(tables[names[0]])
    rows = []
    for subject in subjects:
        cells = [subject, str(tables[names[0]][subject].total)]
        cells += [_cell(tables[n][subject]) for n in names]
        rows.append(cells)
    rows.append(["all", str(len(runs[names[0]])), *(_cell(accuracy(runs[n])) for n in names)])
    return format_table(["subject", "n", *names], rows)


def _cell(acc: Accuracy) -> str:
    lo, hi = acc.interval
    return f"{acc.rate:.3f} [{lo:.3f}, {hi:.3f}]"
