"""`batchgen eval` help texts render as written (argparse's % escapes included), and
cost no torch import; the eval package's names load on first use."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.api.cli import build_parser


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_help_text_shows_an_escaped_percent_sign():
    helps = {p.prog: p.format_help() for p in _parsers(build_parser())}
    assert "batchgen eval mc" in helps
    assert {prog: h for prog, h in helps.items() if "%%" in h} == {}
    assert "95% Wilson interval" in " ".join(helps["batchgen eval mc"].split())


def test_eval_help_imports_neither_torch_nor_transformers():
    """The eval package loads its modules on first use: `batchgen eval --help` reads
    cli.py alone."""
    code = """
import contextlib, io, sys
from batchgen.api.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["eval", "--help"], ["eval", "mc", "--help"], ["eval", "parity", "--help"]):
        assert main(argv) == 0, argv
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_every_name_of_the_eval_package_is_its_modules_own():
    import batchgen.eval as package

    assert sorted(package.__all__) == sorted(package._HOMES)
    for name in package.__all__:
        home = importlib.import_module(f"batchgen.eval.{package._HOMES[name]}")
        assert getattr(package, name) is getattr(home, name), name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no_such_name"):
        package.no_such_name  # noqa: B018
