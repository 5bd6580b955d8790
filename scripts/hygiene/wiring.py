"""Wiring: under src/batchgen/engine/ and src/batchgen/kv/ a component is handed what it
depends on when it is built (engine/builder.py builds the engine's), never given it
afterwards, so that reading a constructor tells everything an object works with. No
assignment (`=`, annotated or not; a counter's `+=` is not wiring) targets an attribute
of an object other than the one whose method runs:

- through an object `self` holds: `self.kv.tier = tier`, `self.tier.states.mirror = log`;
- of an object the function has built from one of the package's classes that is not
  plain data (a dataclass or a NamedTuple): `tier = TieredKVManager(...)` then
  `tier.states = states`;
- by `setattr(obj, ...)` on anything but `self`.

Plain data is written by whoever holds it: an attribute of a parameter or of a local
bound otherwise (a request's status, a step's fields, a copy handle's results) is not
looked at.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from hygiene.paths import PACKAGE
from hygiene.report import Finding
from hygiene.source import Source

FOLDERS = (f"{PACKAGE}/engine/", f"{PACKAGE}/kv/")
RULE = "wiring"
OWN = frozenset({"self", "cls"})


def check_wiring(sources: list[Source]) -> Iterator[Finding]:
    components = component_classes(sources)
    for source in sources:
        if source.path.startswith(FOLDERS):
            for line, what in assignments_to_others(source.tree, components):
                message = f"assigns {what} after it is built; pass it to the constructor"
                yield Finding(source.path, line, RULE, message)


def component_classes(sources: list[Source]) -> frozenset[str]:
    """Names of the package's classes that are not plain data (dataclasses, NamedTuples,
    enums)."""
    names = set()
    for source in sources:
        for node in ast.walk(source.tree):
            if isinstance(node, ast.ClassDef) and not _plain_data(node):
                names.add(node.name)
    return frozenset(names)


def assignments_to_others(tree: ast.Module, components: frozenset[str]) -> list[tuple[int, str]]:
    """(line, the target's text) of each assignment the rule forbids, in line order."""
    found = {}
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _FUNCTIONS))]
    for scope in scopes:
        built = _built_components(scope, components)
        for node in _own_nodes(scope):
            for target in _targets(node):
                if _forbidden(target, built):
                    found[(target.lineno, target.col_offset)] = ast.unparse(target)
            if _setattr_on_another(node):
                found[(node.lineno, node.col_offset)] = (
                    f"an attribute of {ast.unparse(node.args[0])}"
                )
    return [(line, what) for (line, _), what in sorted(found.items())]


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `scope` outside the functions and classes nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _built_components(scope: ast.AST, components: frozenset[str]) -> set[str]:
    """Local names `scope` binds to a construction of one of `components`."""
    names = set()
    for node in _own_nodes(scope):
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _constructs(value, components):
            for target in _targets(node):
                if isinstance(target, ast.Name):
                    names.add(target.id)
    return names


def _constructs(value: ast.AST | None, components: frozenset[str]) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return name in components


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """What an `=` or an annotated assignment binds, tuples and starred names unpacked."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, ast.AnnAssign):
        pending = [node.target]
    else:
        return
    while pending:
        target = pending.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            yield target


def _forbidden(target: ast.expr, built: set[str]) -> bool:
    if not isinstance(target, ast.Attribute):
        return False
    owner = target.value
    if isinstance(owner, ast.Name):
        return owner.id in built
    root = owner
    while isinstance(root, (ast.Attribute, ast.Subscript)):
        root = root.value
    return isinstance(root, ast.Name) and root.id in OWN


def _setattr_on_another(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and bool(node.args)
        and not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN)
    )


def _plain_data(cls: ast.ClassDef) -> bool:
    for decorator in cls.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target).split(".")[-1] == "dataclass":
            return True
    bases = {ast.unparse(b).split(".")[-1] for b in cls.bases}
    return bool(bases & {"NamedTuple", "Enum", "IntEnum", "StrEnum", "TypedDict"})
