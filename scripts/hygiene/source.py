"""Rules on the package's Python source: no print, no BATCHGEN_* environment variables, no
non-blocking upload from pageable memory."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hygiene.paths import in_package
from hygiene.report import Finding

# Environment variables the package may read. Debugging is the `batchgen_debug` flag, so
# every addition here needs a reason in review.
ALLOWED_ENV_VARS: frozenset[str] = frozenset()
ENV_PREFIX = "BATCHGEN_"


@dataclass(frozen=True)
class Source:
    path: str
    text: str
    tree: ast.Module


def load_package_sources(root: Path, paths: list[str]) -> tuple[list[Source], list[Finding]]:
    """Parse every package .py file once; a file that does not parse is itself a finding."""
    sources, findings = [], []
    for path in paths:
        if not (in_package(path) and path.endswith(".py")):
            continue
        try:
            text = (root / path).read_text(encoding="utf-8")
            sources.append(Source(path, text, ast.parse(text, filename=path)))
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            line = getattr(exc, "lineno", 0) or 0
            findings.append(Finding(path, line, "syntax", f"cannot parse: {exc}"))
    return sources, findings


def check_prints(source: Source) -> Iterator[Finding]:
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            yield Finding(source.path, node.lineno, "print", "print() call; use logging")


def check_env_vars(source: Source, allowed: frozenset[str] = ALLOWED_ENV_VARS) -> Iterator[Finding]:
    for line, name in env_var_reads(source.tree):
        if name.startswith(ENV_PREFIX) and name not in allowed:
            message = f"reads environment variable {name}; use a config field or batchgen_debug"
            yield Finding(source.path, line, "env-var", message)


# Calls that build a host tensor; torch.tensor and torch.as_tensor can build it pinned
# (pin_memory=...), torch.from_numpy cannot.
HOST_BUILDERS = {"torch.tensor": True, "torch.as_tensor": True, "torch.from_numpy": False}


def check_pageable_uploads(source: Source) -> Iterator[Finding]:
    """`torch.tensor(...).to(dev, non_blocking=True)` (or .cuda) from pageable memory is not
    reliably asynchronous: CUDA may stage pageable data through its own pinned buffer and
    synchronise with the stream first, so on the compute stream the host can stall behind
    the step in flight. The tensor must be built with pin_memory=... (or staged through a
    pinned buffer)."""
    for node in ast.walk(source.tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("to", "cuda")
            and isinstance(node.func.value, ast.Call)
            and any(k.arg == "non_blocking" for k in node.keywords)
        ):
            continue
        built = node.func.value
        builder = ast.unparse(built.func)
        if builder not in HOST_BUILDERS:
            continue
        pinned = HOST_BUILDERS[builder] and any(
            k.arg == "pin_memory"
            and not (isinstance(k.value, ast.Constant) and k.value.value is False)
            for k in built.keywords
        )
        if not pinned:
            message = (
                f"non-blocking upload of a pageable {builder}(...) may make the host wait for "
                "the stream; build it with pin_memory=... or stage it in a pinned buffer"
            )
            yield Finding(source.path, node.lineno, "pageable-upload", message)


def env_var_reads(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) for os.environ[...], os.environ.get/pop/setdefault, os.getenv and `in`."""
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and _is_env_getter(node.func):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            if isinstance(node.ops[0], (ast.In, ast.NotIn)) and _is_environ(node.comparators[0]):
                key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield node.lineno, key.value


def _is_environ(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_env_getter(func: ast.AST) -> bool:
    if isinstance(func, ast.Name):
        return func.id == "getenv"
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "getenv":
        return isinstance(func.value, ast.Name) and func.value.id == "os"
    return func.attr in ("get", "pop", "setdefault") and _is_environ(func.value)
