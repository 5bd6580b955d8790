"""What a rule reports, and how a run is summarised."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One broken rule: where (repo-relative path or commit), which rule, and why."""

    where: str
    line: int  # 1-based; 0 when the finding is about the whole file or commit
    rule: str
    message: str
    blocking: bool = True

    def __str__(self) -> str:
        place = f"{self.where}:{self.line}" if self.line else self.where
        kind = self.rule if self.blocking else f"{self.rule}, advisory"
        return f"{place}: [{kind}] {self.message}"


def summarise(findings: Iterable[Finding]) -> int:
    """Print every finding and the totals; return the exit status (1 when anything blocks)."""
    ordered = sorted(findings, key=lambda f: (not f.blocking, f.where, f.line, f.rule))
    for finding in ordered:
        print(finding)
    blocking = sum(f.blocking for f in ordered)
    print(f"blocking: {blocking}, advisory: {len(ordered) - blocking}")
    return 1 if blocking else 0
