"""Layering: a module never imports a layer above its own.

Layers, top to bottom, are LAYER_ORDER. Modules directly in src/batchgen (config.py,
sampling_params.py, ...) are common ground any layer may import; but a subpackage must
not import names from batchgen/__init__.py (`from batchgen import LLM`), which re-exports
the top layers and so creates import cycles. Imports under `if TYPE_CHECKING:` are free.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import PurePosixPath

from hygiene.paths import PACKAGE, in_package
from hygiene.report import Finding
from hygiene.source import Source

LAYER_ORDER = [
    "api",
    "eval",
    "engine",
    "kv",
    "distributed",
    "runner",
    "models",
    "layers",
    "kernels",
]
ROOT_PACKAGE = "batchgen"


def check_layering(sources: list[Source], paths: list[str]) -> Iterator[Finding]:
    top_modules = _top_level_modules(paths)
    for source in sources:
        package = _package_of(source.path)
        if len(package) < 2 or package[1] not in LAYER_ORDER:
            continue  # common ground, or a folder reported by check_layer_folders
        for line, target, from_root in imported_modules(source.tree, package):
            if from_root and target[1] not in LAYER_ORDER and target[1] not in top_modules:
                message = f"imports '{target[1]}' from batchgen/__init__.py; import its module"
                yield Finding(source.path, line, "init-import", message)
            else:
                yield from _check_layer(source.path, line, package[1], target)


def check_layer_folders(paths: list[str]) -> Iterator[Finding]:
    """Every first-level package folder should have a place in LAYER_ORDER."""
    modules = [p for p in paths if in_package(p) and p.endswith(".py") and p.count("/") > 2]
    folders = {PurePosixPath(p).parts[2] for p in modules}
    for folder in sorted(folders - set(LAYER_ORDER)):
        message = f"package folder '{folder}' has no place in LAYER_ORDER"
        yield Finding(f"{PACKAGE}/{folder}", 0, "layering", message, blocking=False)


def imported_modules(tree: ast.Module, package: list[str]) -> Iterator[tuple[int, list[str], bool]]:
    """(line, dotted parts, from_root) of each run-time import; `from m import a` yields m.a.

    from_root is True for `from batchgen import a` (or `from .. import a` that resolves to
    it), where `a` may be a module or a name defined in batchgen/__init__.py.
    """
    for node in _runtime_imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split("."), False
            continue
        base = resolve_from(node, package)
        if base is not None:
            for alias in node.names:
                yield node.lineno, [*base, alias.name], base == [ROOT_PACKAGE]


def _check_layer(path: str, line: int, layer: str, target: list[str]) -> Iterator[Finding]:
    if len(target) < 2 or target[0] != ROOT_PACKAGE or target[1] not in LAYER_ORDER:
        return
    if LAYER_ORDER.index(target[1]) < LAYER_ORDER.index(layer):
        message = f"layer '{layer}' imports higher layer '{target[1]}' ({'.'.join(target)})"
        yield Finding(path, line, "layering", message)


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and is_type_checking(node.test):
        for stmt in node.orelse:
            yield from _runtime_imports(stmt)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _runtime_imports(child)


def is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def resolve_from(node: ast.ImportFrom, package: list[str]) -> list[str] | None:
    """The absolute dotted parts of the module a `from` import reads from."""
    module = node.module.split(".") if node.module else []
    if node.level == 0:
        return module
    if node.level - 1 >= len(package):
        return None
    return package[: len(package) - node.level + 1] + module


def _package_of(path: str) -> list[str]:
    """src/batchgen/engine/scheduler.py -> ["batchgen", "engine"] (the importing package)."""
    return list(PurePosixPath(path).relative_to("src").parts[:-1])


def _top_level_modules(paths: list[str]) -> set[str]:
    names = set()
    for path in paths:
        p = PurePosixPath(path)
        if str(p.parent) == PACKAGE and p.suffix == ".py" and p.stem != "__init__":
            names.add(p.stem)
    return names
