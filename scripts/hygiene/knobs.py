"""No hidden knobs: tests and benchmarks never set a module global of the package.

module-global   a test or benchmark that assigns, monkeypatches or deletes a module-level
                constant of the package (an UPPER_CASE name assigned at module level in
                src/batchgen/) changes the package for everything that runs after it in the
                process, and leaves a reader of the package unable to tell which values
                it runs with. A choice a user may make is an EngineConfig field; a value a
                test needs to vary is an argument of the function or constructor that uses
                it (issue 48). Spies that wrap a function or a method are not knobs and are
                not flagged.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from hygiene.paths import in_package
from hygiene.report import Finding

CHECKED = ("tests/", "benchmarks/")
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
SETTERS = {"setattr", "delattr"}  # builtins and monkeypatch's methods alike


def package_constants(root: Path, listed: Iterable[str]) -> frozenset[str]:
    """The UPPER_CASE names the package's modules assign at module level."""
    names: set[str] = set()
    for path in listed:
        if not (in_package(path) and path.endswith(".py")):
            continue
        try:
            tree = ast.parse((root / path).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # reported by the source rules
        for node in tree.body:
            for target in _assigned(node):
                if isinstance(target, ast.Name) and CONSTANT.match(target.id):
                    names.add(target.id)
    return frozenset(names)


def check_module_globals(root: Path, listed: Iterable[str]) -> list[Finding]:
    listed = list(listed)
    constants = package_constants(root, listed)
    findings: list[Finding] = []
    for path in listed:
        if not (path.startswith(CHECKED) and path.endswith(".py")):
            continue
        try:
            tree = ast.parse((root / path).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # fails when run
        for line, name in flipped_globals(tree, constants):
            message = (
                f"sets the package's module global {name}; make it an EngineConfig field "
                "or an argument of what uses it, and pass that"
            )
            findings.append(Finding(path, line, "module-global", message))
    return findings


def flipped_globals(tree: ast.AST, constants: frozenset[str]) -> Iterator[tuple[int, str]]:
    """(line, name) of every assignment, augmented assignment, deletion, setattr/delattr
    call (monkeypatch's included, by object or by dotted "batchgen.x.NAME" string) that
    targets an attribute named like one of `constants`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            for target in _assigned(node):
                for attr in _attributes(target):
                    if attr.attr in constants:
                        yield attr.lineno, attr.attr
        elif isinstance(node, ast.Call) and _callee(node.func) in SETTERS and node.args:
            name = _setattr_name(node.args)
            if name in constants:
                yield node.lineno, name


def _assigned(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _attributes(target: ast.AST) -> Iterator[ast.Attribute]:
    """Attribute targets, inside tuple and list targets too (`saved, m.X = m.X, v`)."""
    if isinstance(target, ast.Attribute):
        yield target
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _attributes(element)
    elif isinstance(target, ast.Starred):
        yield from _attributes(target.value)


def _setattr_name(args: list[ast.expr]) -> str | None:
    """The attribute a setattr-like call sets: its second argument, or the last part of a
    dotted string first argument naming a package attribute (monkeypatch's form)."""
    first = _constant_str(args[0])
    if first is not None and first.startswith("batchgen.") and "." in first:
        return first.rsplit(".", 1)[1]
    return _constant_str(args[1]) if len(args) > 1 else None


def _callee(func: ast.AST) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _constant_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
