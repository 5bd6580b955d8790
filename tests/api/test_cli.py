"""The `batchgen` command's own options: --version."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from batchgen.api.cli import EXIT_OK, main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_version_prints_the_package_metadata_version(capsys):
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out == f"batchgen {metadata.version('batchgen')}\n"


def test_version_is_not_a_usage_error_from_the_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "--version"],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"batchgen {metadata.version('batchgen')}"
    assert done.stderr == ""
