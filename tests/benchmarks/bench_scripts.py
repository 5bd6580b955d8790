"""Importing the scripts of benchmarks/ (not a package) in their --small tests, and
checking their rates against what a test knows apart from the script."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """The benchmarks/ module `name`, imported with benchmarks/ on sys.path only while
    importing (its own imports of workloads, engine_runs, ... resolve there)."""
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def run_timed(script, argv: list[str]) -> float:
    """`script`.main(argv), which must exit 0; the seconds it took by this test's clock."""
    start = time.perf_counter()
    assert script.main(argv) == 0
    return time.perf_counter() - start


def rate_of(run: dict, tokens: int, elapsed: float) -> float:
    """A timed run's output tok/s from what the test knows apart from the script: the
    tokens its workload asks for, over a wall time that lies inside the `elapsed` seconds
    the test measured around the script. The run's own figures must agree."""
    assert run["output_tokens"] == tokens
    assert 0 < run["wall_s"] < elapsed
    assert run["tok_s"] == pytest.approx(tokens / run["wall_s"])
    return tokens / run["wall_s"]
