"""Importing the scripts of benchmarks/ (not a package) in their --small tests."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """The benchmarks/ module `name`, imported with benchmarks/ on sys.path only while
    importing (its own imports of workloads, engine_runs, ... resolve there)."""
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))
