"""Rules on file names and folders: no tests, scratch files or artifacts where they do not belong."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from pathlib import PurePosixPath

from hygiene.report import Finding

PACKAGE = "src/batchgen"
SCRATCH_PREFIXES = ("debug_", "check_", "scratch_", "tmp_")
ARTIFACT_SUFFIXES = (
    ".log", ".csv", ".whl", ".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".gguf",
    ".pyc", ".pyo", ".so", ".o", ".trace", ".nsys-rep", ".qdrep", ".prof",
)  # fmt: skip
ARTIFACT_PATTERNS = ("trace*.json",)
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py", "conftest.py")


def in_package(path: str) -> bool:
    return path.startswith(PACKAGE + "/")


def check_test_files(paths: list[str]) -> Iterator[Finding]:
    """Nothing test-only inside the package: no test modules, conftest or tests/ folder."""
    for path in paths:
        p = PurePosixPath(path)
        in_tests_dir = path.startswith("src/") and "tests" in p.parts[:-1]
        is_test_file = in_package(path) and _matches(p.name, TEST_FILE_PATTERNS)
        if in_tests_dir or is_test_file:
            yield Finding(path, 0, "test-in-package", "tests belong under tests/, not in src/")


def check_scratch_files(paths: list[str]) -> Iterator[Finding]:
    """No debug_/check_/scratch_/tmp_ files in the package or the repository root."""
    for path in paths:
        name = PurePosixPath(path).name
        at_root = "/" not in path
        if (at_root or in_package(path)) and name.startswith(SCRATCH_PREFIXES):
            yield Finding(path, 0, "scratch-file", "scratch file; delete it or give it a home")


def check_artifacts(paths: list[str]) -> Iterator[Finding]:
    """No logs, traces, CSVs, checkpoints, wheels or compiled files anywhere."""
    for path in paths:
        name = PurePosixPath(path).name
        if name.endswith(ARTIFACT_SUFFIXES) or _matches(name, ARTIFACT_PATTERNS):
            yield Finding(path, 0, "artifact", "generated file (log/trace/data/binary) in git")


def check_module_docs(paths: list[str]) -> Iterator[Finding]:
    """Every package folder holding .py files, the package root included, has a MODULE.md."""
    listed = set(paths)
    folders = {PACKAGE}
    folders |= {str(PurePosixPath(p).parent) for p in paths if in_package(p) and p.endswith(".py")}
    for folder in sorted(folders):
        if f"{folder}/MODULE.md" not in listed:
            yield Finding(f"{folder}/MODULE.md", 0, "module-md", "package folder lacks MODULE.md")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
