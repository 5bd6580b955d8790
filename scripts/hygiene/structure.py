"""Rules on the package's modules as a whole: no file over MAX_LINES lines, no import cycle.

A newcomer reads one module at a time: a file past a few hundred lines holds more than
one idea, and two modules that import each other (directly or through others) must be
read together. The cycle rule counts every import, inside functions and under
`if TYPE_CHECKING:` too (a cycle dodged at run time is still one to read), except a
TYPE_CHECKING import of a higher layer, which layering.py allows for annotations.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import PurePosixPath

from hygiene.layering import LAYER_ORDER, is_type_checking, resolve_from
from hygiene.report import Finding
from hygiene.source import Source

MAX_LINES = 400
# Files over MAX_LINES that are being split (issue 48): each is reported once it is back
# under the limit, so the entry can go. Empty this list; never add to it.
OVER_LIMIT_FOR_NOW: frozenset[str] = frozenset()
# Import cycles being broken (issue 48), each as its modules sorted by name: reported
# once gone, so the entry can go. Empty this list; never add to it.
CYCLES_FOR_NOW: frozenset[tuple[str, ...]] = frozenset()


def check_file_sizes(
    sources: list[Source], allowed: frozenset[str] = OVER_LIMIT_FOR_NOW
) -> Iterator[Finding]:
    for source in sources:
        lines = len(source.text.splitlines())
        if lines > MAX_LINES and source.path not in allowed:
            message = f"{lines} lines, over {MAX_LINES}: split it along a seam"
            yield Finding(source.path, 0, "file-size", message)
        elif lines <= MAX_LINES and source.path in allowed:
            message = f"{lines} lines now: remove it from structure.OVER_LIMIT_FOR_NOW"
            yield Finding(source.path, 0, "file-size", message, blocking=False)


def check_import_cycles(
    sources: list[Source], allowed: frozenset[tuple[str, ...]] = CYCLES_FOR_NOW
) -> Iterator[Finding]:
    """One finding per cycle, on its first module (sorted), naming every module in it."""
    modules = {module_name(s.path): s for s in sources}
    graph = {name: set(_imports(s, modules)) - {name} for name, s in modules.items()}
    found = set()
    for cycle in _cycles(graph):
        found.add(tuple(sorted(cycle)))
        if tuple(sorted(cycle)) not in allowed:
            message = "import cycle: " + " -> ".join([*cycle, cycle[0]])
            yield Finding(modules[cycle[0]].path, 0, "import-cycle", message)
    for gone in sorted(allowed - found):
        if gone[0] in modules:
            message = f"no cycle through {', '.join(gone)} now: remove it from CYCLES_FOR_NOW"
            yield Finding(modules[gone[0]].path, 0, "import-cycle", message, blocking=False)


def module_name(path: str) -> str:
    """src/batchgen/kv/pool.py -> batchgen.kv.pool; src/batchgen/kv/__init__.py -> batchgen.kv."""
    parts = list(PurePosixPath(path).relative_to("src").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: Source, modules: dict[str, Source]) -> Iterator[str]:
    """The package modules `source` imports: for `from a.b import c`, a.b.c when it is a
    module, else a.b (the longest dotted prefix that is one)."""
    package = list(PurePosixPath(source.path).relative_to("src").parts[:-1])
    layer = _layer(package)
    for node, annotation_only in _all_imports(source.tree):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        else:
            base = resolve_from(node, package)
            targets = [] if base is None else [[*base, alias.name] for alias in node.names]
        for target in targets:
            name = next(
                (m for k in range(len(target), 0, -1) if (m := ".".join(target[:k])) in modules),
                None,
            )
            if name is None:
                continue
            if annotation_only and _above(_layer(name.split(".")[:2]), layer):
                continue  # layering's exception: annotations may name a higher layer
            yield name


def _all_imports(node: ast.AST, annotation_only: bool = False):
    """(import node, under `if TYPE_CHECKING:`) for every import in the tree."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, annotation_only
    elif isinstance(node, ast.If) and is_type_checking(node.test):
        for stmt in node.body:
            yield from _all_imports(stmt, True)
        for stmt in node.orelse:
            yield from _all_imports(stmt, annotation_only)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _all_imports(child, annotation_only)


def _layer(package: list[str]) -> str | None:
    return package[1] if len(package) > 1 and package[1] in LAYER_ORDER else None


def _above(target: str | None, layer: str | None) -> bool:
    if target is None or layer is None:
        return False
    return LAYER_ORDER.index(target) < LAYER_ORDER.index(layer)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each as one cycle through it, starting at its smallest name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return sorted((_cycle_through(graph, c) for c in components), key=lambda c: c[0])


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle from the component's smallest module back to itself (breadth
    first inside the component), as the modules along it."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    return sorted(component)  # unreachable: a component's members reach each other
