"""Importing the modules of the benchmarks package in their --small tests, and checking
their rates against what a test knows apart from the script."""

from __future__ import annotations

import importlib
import time

import pytest


def load(name: str):
    """The module benchmarks.`name` (the package at the repository root, which
    pyproject's pytest `pythonpath` puts on sys.path)."""
    return importlib.import_module(f"benchmarks.{name}")


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
