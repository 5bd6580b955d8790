"""The copy-ordering rules of the tiered KV cache, checked on the AST of the package. The rules
are numbered once, in src/batchgen/kv/copy_rules.py; a finding is named `copy-<line>` after the
line of that table it breaks (copy-3a), and each paragraph below says how that line is checked.

Host<->device copies run on side streams from a worker thread; each rule closes one way for a
copy to race the compute stream. The checks follow the code's structure (what is handed to what,
which statement precedes which), not function names, so they keep holding while the tier is
refactored; the few names they start from (CopyEngine, kv/page_copies.py, the runner's
`wait_for`, the forward context's `before_layer`) must exist while the tier does.

1a  A copy body (a function of kv/page_copies.py that issues a copy; its name says its direction:
    device_to_host* or host_to_device*), reached by its name, an alias or its module, is only
    called inside a closure (lambda or nested def) that its enclosing function hands to
    CopyEngine.submit and uses nowhere else, and submit never runs the closure itself. Anything
    else issues the copy without the producer event submit records at call time. A gather
    (a function of page_copies.py named gather_*) reads device pages into new staging on the
    stream that calls it and may run anywhere; it copies nothing itself (no copy method,
    non-blocking transfer or subscript assignment, no copy body called; its index goes up
    through forward_context.to_device), so its staging reaches the host only through a
    submitted copy body.
1b  Nothing outside page_copies.py writes into a KV pool tensor (the tensors the kv package's
    pool classes own, their views, names bound to them): no subscript assignment, no
    copy_/index_copy_/index_put_ or out= into one, and no .to/.cuda/.pin_memory/non_blocking
    transfer of one; a blocking .cpu()/.to() read of a pool only after a .synchronize() earlier
    in the function. In the tier's own modules (kv/, page_copies.py and copy_engine.py aside)
    no copy call at all. Such a copy skips the ordering and the keep-alive of its tensors.
1c  CopyEngine.submit records the producer event on torch.cuda.current_stream(...) on every
    path, then queues it.
2a  The worker runs a task's callables only on a copy stream that waited, unconditionally, on
    that producer (or on the CPU path, under the else of an `if ...cuda...`). No class derives
    from CopyEngine and nothing assigns one of its methods, on the class or an instance (the
    unordered engine of the GPU regression tests lives under tests/).
2b  Work under `with torch.cuda.stream(S):` is preceded, in the same function and on every path,
    by an unconditional S.wait_event(...) or S.wait_stream(...). torch.cuda.set_stream is
    refused.
3a  A host page (or state slot) is not read before its store completes: every store records
    its handle under each of its host pages in a map (in a loop of the submitting function, or
    of a helper it hands the handle and the pages on every path: CopyLedger.record_store, from
    CopyLedger.store, the one place rank 0 and the workers submit stores), and every closure
    running a host_to_device* body first waits for the whole of each store that map holds for
    the body's host pages (wait_on_current_stream/synchronize; a gate is not enough), looked
    up there or by a helper whose every return looks them up (CopyLedger.stores_of, from
    CopyLedger.load).
3b  Compute waits for the step's copies: a function reading a step's copy handles (`.wait_for`)
    waits on each of them before every forward it runs (a graph replay, or a call that
    reaches one or binds a forward context), or binds a ForwardContext whose before_layer
    waits on them; a layer reads its KV caches from the forward context only after calling
    the context's before_layer.
3c  A tensor-parallel worker's forward waits for the copies it replays: wherever a TierMirror's
    `issue(...)` (kv/tier_mirror.py) runs, the handles it returns are bound to a name that the
    same function, after the issue, hands as `wait_for=` to the step it passes on (an argument
    of a call); and while TierMirror exists something issues its copies. Otherwise a worker's
    forward could read pages its own loads have not written, or write pages its stores have not
    read.
6a  No copy overlaps a CUDA-graph capture: a capture (`with torch.cuda.graph(...)`) runs only
    inside `with self.<guard>():` (itself, or every call of its function); the guard comes from
    the constructor; every construction passes a CopyEngine pause (a contextmanager of
    CopyEngine that raises a flag) as the guard; and the worker waits while that flag is up
    before it runs a task. A builder function may pass the pause of a CopyEngine parameter
    instead: then every call of the builder passes a CopyEngine there (or one if something
    holds, else None).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

from hygiene.report import Finding

COPY_PREFIXES = ("device_to_host", "host_to_device")
GATHER_PREFIX = "gather_"  # page_copies.py: a device-side read into staging (1a)
COPY_METHODS = {"copy_", "index_copy_", "index_put_", "index_add_", "scatter_", "masked_scatter_"}
TRANSFERS = {"to", "cuda", "cpu", "pin_memory"}
READS = {"to", "cpu"}
NEW_TENSOR = TRANSFERS | {"clone", "float", "half", "double", "bfloat16", "numpy", "tolist", "item"}
FACTORIES = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "empty_strided"}
POOL_ALLOCATORS = {"host_empty", "pool_zeros"}  # kv/pinned.py: host pools, device pools
STREAM_CTX = {"torch.cuda.stream", "cuda.stream", "torch.cuda.StreamContext"}
CURRENT_STREAM = ("torch.cuda.current_stream(", "cuda.current_stream(")
WHOLE_WAITS = {"wait_on_current_stream", "synchronize"}
CONSUMER_WAITS = {"wait_layer", "wait_gates", "wait_on_current_stream", "synchronize"}
HOST_INDICES = ("host_pages", "host_slots")  # a copy body's parameter naming host pages
CARRIER = "wait_for"  # SchedulerOutput: the copy handles a step's forward waits on
MIRROR = ("kv/tier_mirror.py", "TierMirror", "issue")  # a worker's replay of rank 0's copies
HOOK = "before_layer"  # ForwardContext: called by each layer before it touches its KV
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
FUNCS = (*DEFS, ast.Lambda)


# node -> its subtree; (node, types) -> the subtree's nodes of those types: computed
# once, kept while the node's module is (_LAST_PARSED)
_WALKS: dict[ast.AST, list[ast.AST]] = {}
_WALKS_OF: dict[tuple[ast.AST, tuple], list[ast.AST]] = {}


# the last check's modules by (src/batchgen/... path, text), which no check changes: a
# check of a copy of the package that differs from the last in a file or two (the
# mutations of tests/kv/test_copy_contract.py) parses only those again
_LAST_PARSED: dict[tuple[str, str], _Module] = {}


def _walk(node: ast.AST) -> list[ast.AST]:
    """ast.walk(node), computed once per node during a check."""
    found = _WALKS.get(node)
    if found is None:
        found = _WALKS[node] = list(ast.walk(node))
    return found


def _walk_of(node: ast.AST, types: tuple) -> list[ast.AST]:
    """The nodes of _walk(node) that are instances of `types`, in its order."""
    found = _WALKS_OF.get((node, types))
    if found is None:
        found = _WALKS_OF[node, types] = [n for n in _walk(node) if isinstance(n, types)]
    return found


def _dotted(node: ast.AST) -> str | None:
    """The text of a name or a dotted path of attributes (`a`, `a.b.c`), else None: what
    an imported module's name can be."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


IMPORTS = (ast.Import, ast.ImportFrom)
ASSIGNS = (ast.Assign, ast.AnnAssign)
BINDINGS = (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.withitem)
WRITES = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Call)  # what _pool_copy looks at


class _Module:
    """One parsed file of the package, with parent links and its annotation nodes."""

    def __init__(self, root: Path, path: Path, text: str) -> None:
        self.rel = path.relative_to(root).as_posix()  # kv/tiered.py
        self.where = path.relative_to(root.parent.parent).as_posix()  # src/batchgen/kv/...
        self.package = [root.name, *Path(self.rel).parts[:-1]]
        self.tree = ast.parse(text, filename=str(path))
        self.parent = {c: n for n in _walk(self.tree) for c in ast.iter_child_nodes(n)}
        notes = [getattr(n, "annotation", None) for n in _walk(self.tree)]
        notes += [n.returns for n in _walk(self.tree) if isinstance(n, DEFS)]
        self.annotations = {id(x) for a in notes if a is not None for x in _walk(a)}
        # the loaded names by name and the attributes by the text of their value, each with
        # its place in the walk (refs look them up by name instead of walking the tree)
        self.loads: dict[str, list[tuple[int, ast.AST]]] = {}
        self.attrs_of: dict[str, list[tuple[int, ast.AST]]] = {}
        for i, n in enumerate(_walk(self.tree)):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                self.loads.setdefault(n.id, []).append((i, n))
            elif isinstance(n, ast.Attribute) and (value := _dotted(n.value)) is not None:
                self.attrs_of.setdefault(value, []).append((i, n))

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parent:
            node = self.parent[node]
            yield node

    def func_of(self, node: ast.AST) -> ast.AST | None:
        """The innermost def or lambda around node (None at module or class level)."""
        for a in self.ancestors(node):
            if isinstance(a, FUNCS):
                return a
            if isinstance(a, ast.ClassDef):
                return None
        return None

    def scope_of(self, node: ast.AST) -> ast.AST:
        """The outermost function around node (closures share its names), else the module."""
        funcs = [a for a in self.ancestors(node) if isinstance(a, FUNCS)]
        return funcs[-1] if funcs else self.tree

    def class_of(self, node: ast.AST) -> ast.ClassDef | None:
        return next((a for a in self.ancestors(node) if isinstance(a, ast.ClassDef)), None)

    def in_submitted(self, node: ast.AST, is_submit: Callable[[ast.AST], bool]) -> bool:
        """node runs in a closure that its enclosing function hands to a submit call and uses
        nowhere else (not called directly, stored or passed elsewhere)."""
        fn = self.func_of(node)
        outer = fn and self.func_of(fn)
        if outer is None:
            return False
        if isinstance(fn, ast.Lambda) and is_submit(self.parent[fn]):
            return any(a is fn for a in _args(self.parent[fn]))
        name = getattr(fn, "name", None)
        if isinstance(self.parent[fn], ast.Assign):  # copy = lambda h: ...
            name = getattr(self.parent[fn].targets[0], "id", None)
        uses = [n for n in _walk(outer) if isinstance(n, ast.Name) and n.id == name]
        calls = [self.parent[u] for u in uses if isinstance(u.ctx, ast.Load)]
        calls = [self.parent[c] if isinstance(c, ast.keyword) else c for c in calls]
        return bool(calls) and all(is_submit(c) and self.func_of(c) is outer for c in calls)


class _Package:
    def __init__(self, modules: list[_Module]) -> None:
        self.modules = modules
        self.by_rel = {m.rel: m for m in modules}
        self._refs: dict[tuple, list[tuple]] = {}
        self.funcs_named: dict[str, list[tuple[_Module, ast.AST]]] = {}
        for m in modules:
            for f in _walk(m.tree):
                if isinstance(f, DEFS):
                    self.funcs_named.setdefault(f.name, []).append((m, f))

    def classes(self, rel: str, pred: Callable[[ast.ClassDef], bool]) -> list[ast.ClassDef]:
        m = self.by_rel.get(rel)
        return [c for c in (m.tree.body if m else []) if isinstance(c, ast.ClassDef) and pred(c)]

    def refs(self, m: _Module, home: str, names: set[str] | None = None) -> list[tuple]:
        """(node, name) for each use in m of a top-level name of module `home` (kv/tiered.py),
        however it is imported: by name, alias, its module or a dotted path."""
        key = (m.rel, home, frozenset(names) if names is not None else None)
        if key not in self._refs:
            self._refs[key] = list(self._find_refs(m, home, names))
        return self._refs[key]

    def _find_refs(self, m: _Module, home: str, names: set[str] | None) -> Iterator[tuple]:
        target = [m.package[0], *Path(home).with_suffix("").parts]
        funcs, mods = {}, {".".join(target)}
        if m.rel == home:
            funcs = {n: n for n in (names or ())}
        for node in _walk_of(m.tree, IMPORTS):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(node, m.package)
                for a in node.names:
                    if base == target and (names is None or a.name in names or a.name == "*"):
                        funcs[a.asname or a.name] = a.name
                        yield from [(node, "*")] if a.name == "*" else []
                    elif base == target[:-1] and a.name == target[-1]:
                        mods.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                mods |= {a.asname for a in node.names if a.name == ".".join(target) and a.asname}
        found = [(i, n, funcs[name]) for name in funcs for i, n in m.loads.get(name, ())]
        found += [
            (i, n, n.attr)
            for mod in mods
            for i, n in m.attrs_of.get(mod, ())
            if names is None or n.attr in names
        ]
        yield from ((n, name) for _, n, name in sorted(found, key=lambda f: f[0]))


class _Types:
    """Names and attributes bound to instances of some classes: by construction (a call of
    the class or of a class method), by annotation, or copied from another such name."""

    def __init__(self, pkg: _Package, home: str, classes: set[str]) -> None:
        self.pkg = pkg
        self.ref_ids = {m.rel: {id(n) for n, _ in pkg.refs(m, home, classes)} for m in pkg.modules}
        self.attrs: set[str] = set()
        self._locals: dict[tuple[str, int], set[str]] = {}
        while True:
            before, self._locals = len(self.attrs), {}
            for m in pkg.modules:
                for node in _walk_of(m.tree, ASSIGNS):
                    if node.value is not None:
                        for t in _targets(node):
                            if isinstance(t, ast.Attribute) and self.typed(m, node.value):
                                self.attrs.add(t.attr)
            if len(self.attrs) == before:
                return

    def is_class(self, m: _Module, node: ast.AST) -> bool:
        return id(node) in self.ref_ids[m.rel]

    def local_names(self, m: _Module, node: ast.AST) -> set[str]:
        scope = m.scope_of(node)
        key = (m.rel, id(scope))
        if key not in self._locals:
            self._locals[key] = set()  # no recursion while it is computed
            names = {
                a.arg
                for f in _walk_of(scope, FUNCS)
                for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]
                if a.annotation is not None
                and any(self.is_class(m, x) for x in _walk(a.annotation))
            }
            self._locals[key] = _bind(scope, names, lambda v, n: self._typed(m, v, n))
        return self._locals[key]

    def typed(self, m: _Module, expr: ast.AST) -> bool:
        return self._typed(m, expr, self.local_names(m, expr))

    def _typed(self, m: _Module, expr: ast.AST, names: set[str]) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in names
        if isinstance(expr, ast.Attribute):
            return expr.attr in self.attrs
        if isinstance(expr, ast.Call):
            f = expr.func
            return self.is_class(m, f) or (
                isinstance(f, ast.Attribute) and self.is_class(m, f.value)
            )
        if isinstance(expr, ast.IfExp):
            return self._typed(m, expr.body, names) or self._typed(m, expr.orelse, names)
        if isinstance(expr, ast.BoolOp):
            return any(self._typed(m, v, names) for v in expr.values)
        return False


def check_copy_contract(src_root: Path, files: Iterable[Path] | None = None) -> list[Finding]:
    """Violations of the copy-ordering rules in the package at src_root (the src/batchgen folder); `files`, when
    given, are the package's .py files to read (else every one under src_root)."""
    root, modules, problems = Path(src_root).resolve(), [], []
    parsed: dict[tuple[str, str], _Module] = {}
    try:
        for path in sorted(Path(p).resolve() for p in (files or root.rglob("*.py"))):
            try:
                text = path.read_text(encoding="utf-8")
                key = (path.relative_to(root.parent.parent).as_posix(), text)
                m = _LAST_PARSED.get(key) or _Module(root, path, text)
                modules.append(parsed.setdefault(key, m))
            except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
                where = path.relative_to(root.parent.parent).as_posix()
                line = getattr(exc, "lineno", 0) or 0
                problems.append(Finding(where, line, "syntax", str(exc)))
        return problems + [_finding(m, *p) for m, p in _check_package(_Package(modules))]
    finally:
        _LAST_PARSED.clear()
        _LAST_PARSED.update(parsed)
        # the walks of the trees kept for the next check stay true; the others go
        kept = {id(n) for m in parsed.values() for n in (m.tree, *m.parent)}
        for cache, node_of in ((_WALKS, lambda k: k), (_WALKS_OF, lambda k: k[0])):
            for key in [k for k in cache if id(node_of(k)) not in kept]:
                del cache[key]


def _check_package(pkg: _Package) -> Iterator[tuple[_Module, tuple]]:
    engine_mod = pkg.by_rel.get("kv/copy_engine.py")
    engines = pkg.classes("kv/copy_engine.py", lambda c: c.name == "CopyEngine")
    if engine_mod is None and "kv/page_copies.py" not in pkg.by_rel:  # no host tier
        yield from ((m, p) for m in pkg.modules for p in _check_streams(m))
    elif not engines:
        where = engine_mod or pkg.by_rel["kv/page_copies.py"]
        yield where, (where.tree, "1a", "kv/copy_engine.py defines no CopyEngine")
    else:
        yield from _Contract(pkg, engine_mod, engines[0]).check()


def _finding(m: _Module, node: ast.AST, rule: str, message: str) -> Finding:
    return Finding(m.where, getattr(node, "lineno", 1), f"copy-{rule}", message)


class _Contract:
    def __init__(self, pkg: _Package, engine_mod: _Module, engine: ast.ClassDef) -> None:
        self.pkg, self.em, self.engine = pkg, engine_mod, engine
        self.methods = {f.name: f for f in engine.body if isinstance(f, DEFS)}
        self._forwards: set[str] | None = None
        self.engines = _Types(pkg, "kv/copy_engine.py", {"CopyEngine"})
        # submit: the engine's methods that record a producer event and queue it (1c)
        self.submits = {n for n, f in self.methods.items() if _records(f) and _queues(f)}
        records = [_record_of(self.methods[n]) for n in sorted(self.submits)]
        self.producer = ast.unparse(records[0].func.value).split(".")[-1] if records else ""
        self.copies = pkg.by_rel.get("kv/page_copies.py")
        copying = _copying_functions(self.copies) if self.copies else {}
        self.gathers = {n: f for n, f in copying.items() if n.startswith(GATHER_PREFIX)}
        self.bodies = {n: f for n, f in copying.items() if n not in self.gathers}
        pools = [
            (m.rel, c.name)
            for m in pkg.modules
            if m.rel.startswith("kv/")
            for c in m.tree.body
            if isinstance(c, ast.ClassDef) and _tensor_attrs(c)
        ]
        self.pools = [_Types(pkg, rel, {name}) for rel, name in pools]
        owners = [c for rel, n in pools for c in pkg.classes(rel, lambda c, n=n: c.name == n)]
        self.tensor_attrs = {a for c in owners for a in _tensor_attrs(c)}
        self.view_methods = {
            f.name
            for c in owners
            for f in c.body
            if isinstance(f, DEFS)
            and any(
                isinstance(r, ast.Return)
                and r.value is not None
                and any(_attr(x) in self.tensor_attrs for x in _walk(r.value))
                for r in _walk(f)
            )
        }

    def check(self) -> Iterator[tuple[_Module, tuple]]:
        em = self.em
        found = [*self._check_submit(), *self._check_pause()]
        if not self.submits:
            found.append((self.engine, "1c", "CopyEngine has no submit that records and queues"))
        yield from ((em, p) for p in found)
        if self.copies is not None and not self.bodies:
            yield self.copies, (self.copies.tree, "1a", "page_copies.py issues no copy")
        for name, fn in self.bodies.items():
            if not name.lstrip("_").startswith(COPY_PREFIXES):
                why = f"copy body {name} must say its direction: device_to_host* or host_to_device*"
                yield self.copies, (fn, "1a", why)
        for name, fn in self.gathers.items():
            for node in _walk(fn):
                if _copies(node, self.bodies):
                    why = f"gather {name} copies ({ast.unparse(node)[:60]}): only a copy body may"
                    yield self.copies, (node, "1a", why)
        reads = 0
        for m in self.pkg.modules:
            yield from self._check_capture(m)
            found = [*_check_streams(m), *self._check_engine_kept(m)]
            if m is not self.copies:
                found += [*self._check_bodies(m), *self._check_pool_writes(m)]
            found += [*self._check_loads(m), *self._check_layers(m)]
            readers = self._readers(m)
            reads += len(readers)
            found += [p for fn in readers for p in self._check_consumer(m, fn)]
            yield from ((m, p) for p in found)
        if not reads:
            why = f"nothing reads the step's copy handles (.{CARRIER}): compute waits on nothing"
            yield em, (self.engine, "3b", why)
        yield from self._check_mirror()

    # ---- 1a --------------------------------------------------------------------------------
    def is_submit(self, m: _Module, node: ast.AST) -> bool:
        """A call of CopyEngine's submit on something bound to a CopyEngine."""
        if not (isinstance(node, ast.Call) and _attr(node.func) in self.submits):
            return False
        return self.engines.typed(m, node.func.value) or m is self.em

    def _check_bodies(self, m: _Module) -> Iterator[tuple]:
        submitted = partial(self.is_submit, m)
        for node, name in self.pkg.refs(m, "kv/page_copies.py", set(self.bodies)):
            call = m.parent.get(node)
            if name == "*":
                yield node, "1a", "star import from page_copies hides copy-body calls"
            elif not (getattr(call, "func", None) is node and m.in_submitted(call, submitted)):
                yield node, "1a", f"copy body {name} runs outside a closure handed only to submit()"
        for name in self.submits if m is self.em else ():
            fn = self.methods[name]
            params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
            for c in _calls(fn):
                if getattr(c.func, "id", None) in params:
                    yield c, "1a", f"{name}() runs the copy it was given instead of queueing it"

    # ---- 1b --------------------------------------------------------------------------------
    def _pool_names(self, m: _Module, node: ast.AST) -> set[str]:
        return set().union(*(t.local_names(m, node) for t in self.pools))

    def _is_pool(self, m: _Module, expr: ast.AST, names: set[str]) -> bool:
        return any(t._typed(m, expr, names) for t in self.pools)

    def _pool_tensor(self, m: _Module, pools: set[str], expr: ast.AST, tensors: set[str]):
        """expr is a pool's tensor (`pool.kv`, `pool.page(p)`), a view of it, or a name bound
        to one (pools: the names bound to pools in expr's scope)."""
        while True:
            if isinstance(expr, ast.Name):
                return expr.id in tensors
            if isinstance(expr, ast.Attribute):
                if expr.attr in self.tensor_attrs and self._is_pool(m, expr.value, pools):
                    return True
                expr = expr.value
            elif isinstance(expr, ast.Subscript):
                expr = expr.value
            elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
                f = expr.func
                if f.attr in self.view_methods and self._is_pool(m, f.value, pools):
                    return True
                if f.attr in NEW_TENSOR:
                    return False
                expr = f.value
            else:
                return False

    def _check_pool_writes(self, m: _Module) -> Iterator[tuple]:
        tier = m.rel.startswith("kv/") and m.rel != "kv/copy_engine.py"
        tests: dict[int, Callable[[ast.AST | None], bool]] = {}
        for node in _walk_of(m.tree, WRITES):
            scope = m.scope_of(node)
            if id(scope) not in tests:
                pools = self._pool_names(m, node)
                tensors = _bind(scope, set(), partial(self._pool_tensor, m, pools))
                tests[id(scope)] = partial(self._pool_tensor, m, pools, tensors=tensors)
            what = _pool_copy(m, node, tests[id(scope)], tier)
            if what:
                yield node, "1b", f"{what}: copies between pools go through page_copies"

    # ---- 2a: nothing replaces the engine's producer wait --------------------------------------
    def _check_engine_kept(self, m: _Module) -> Iterator[tuple]:
        """2a: no class of the package derives from CopyEngine and nothing assigns one of
        its methods (on the class or an instance): either could drop the producer wait."""
        refs = self.pkg.refs(m, "kv/copy_engine.py", {"CopyEngine"})
        classes = {id(n) for n, _ in refs}
        for node in _walk(m.tree):
            if isinstance(node, ast.ClassDef):
                if any(id(x) in classes for b in node.bases for x in _walk(b)):
                    yield node, "2a", f"{node.name} derives from CopyEngine: its wait is unseen"
                continue
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                named = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
                if node.args and named and named[0] in self.methods:
                    if self._is_engine(m, node.args[0], classes):
                        yield node, "2a", f"CopyEngine.{named[0]} replaced through setattr"
                continue
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                continue
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and t.attr in self.methods:
                    if self._is_engine(m, t.value, classes):
                        yield node, "2a", f"CopyEngine.{t.attr} replaced by an assignment"

    def _is_engine(self, m: _Module, expr: ast.AST, classes: set[int]) -> bool:
        """expr is the CopyEngine class or something bound to an instance of it."""
        return id(expr) in classes or self.engines.typed(m, expr)

    # ---- 3a --------------------------------------------------------------------------------
    def _submitted_bodies(self, m: _Module) -> Iterator[tuple[ast.Call, ast.Call, str]]:
        """(submit call, body call, body name) for each copy body run in a submitted closure."""
        for node, name in self.pkg.refs(m, "kv/page_copies.py", set(self.bodies)):
            body = m.parent.get(node)
            if name == "*" or getattr(body, "func", None) is not node:
                continue
            fn = m.func_of(body)
            outer = fn and m.func_of(fn)
            if outer is None:
                continue
            for c in _calls(outer):
                if self.is_submit(m, c) and m.func_of(c) is outer:
                    handed = _args(c)
                    named = getattr(fn, "name", None)
                    if isinstance(m.parent[fn], ast.Assign):
                        named = getattr(m.parent[fn].targets[0], "id", None)
                    if any(a is fn or getattr(a, "id", 0) == named for a in handed):
                        yield c, body, name

    def _check_loads(self, m: _Module) -> Iterator[tuple]:
        maps, loads = set(), []
        for submit, body, name in self._submitted_bodies(m):
            if name.lstrip("_").startswith("host_to_device"):
                loads.append((body, name))
                continue
            pages = self._host_pages(body, name)
            recorded = self._store_maps(m, submit, pages)
            maps |= recorded
            if not recorded:
                why = f"the {name} store's handle is not recorded under each of its host pages"
                yield submit, "3a", why + ": a load of those pages cannot wait for it"
        for body, name in loads:
            pages = self._host_pages(body, name)
            if not (maps and pages is not None and self._waits_for_stores(m, body, pages, maps)):
                yield body, "3a", f"{name} runs before waiting for the stores of its host pages"

    def _host_pages(self, call: ast.Call, name: str) -> ast.AST | None:
        """The argument a call of copy body `name` passes as its `host_pages` (its
        `host_slots` for a compressed-state body: a host slot stands for a page)."""
        a = self.bodies[name].args
        params = [p.arg for p in a.posonlyargs + a.args]
        key = next((k for k in HOST_INDICES if k in params), HOST_INDICES[0])
        at = params.index(key) if key in params else -1
        return _arg(call, at, key)

    def _store_maps(self, m: _Module, submit: ast.Call, pages: ast.AST | None) -> set[str]:
        """Maps `self.<M>` that get the submit's handle stored under each of `pages`: in
        the submit's function, or by a helper it hands both, unconditionally (a ledger's
        record_store: a call under an `if` or in a loop may record only some stores)."""
        assign = m.parent.get(submit)
        if pages is None or not isinstance(assign, ast.Assign):
            return set()
        handle, fn = ast.unparse(assign.targets[0]), m.func_of(submit)
        found = _recording_maps(fn, handle, ast.unparse(pages))
        for call in _calls(fn):
            if _conditional(m, call, fn):
                continue
            for helper, given in self._helpers(call):
                if handle in given and ast.unparse(pages) in given:
                    found |= _recording_maps(helper, given[handle], given[ast.unparse(pages)])
        return found

    def _helpers(self, call: ast.Call) -> Iterator[tuple[ast.AST, dict[str, str]]]:
        """(def, {argument source: parameter}) for each package function a call may reach
        by its name."""
        for _, f in self.pkg.funcs_named.get(_callee(call) or "", []):
            params = [a.arg for a in f.args.posonlyargs + f.args.args]
            params = params[1:] if params[:1] == ["self"] else params
            given = {ast.unparse(a): p for a, p in zip(call.args, params)}
            given |= {ast.unparse(k.value): k.arg for k in call.keywords if k.arg}
            yield f, given

    def _waits_for_stores(self, m: _Module, body: ast.Call, pages: ast.AST, maps: set[str]):
        closure = m.func_of(body)
        scope = m.scope_of(body)
        page_name = ast.unparse(pages)

        def looks_up(expr: ast.AST, pages: str) -> bool:  # `self.<M>` of a map, and pages
            looked = any(
                isinstance(x, ast.Attribute) and x.attr in maps and _is_self(x.value)
                for x in _walk(expr)
            )
            return looked and any(ast.unparse(x) == pages for x in _walk(expr))

        def from_maps(expr: ast.AST) -> bool:  # looks the pages up in a store map
            if isinstance(expr, ast.Name):
                values = [
                    a.value
                    for a in _walk(scope)
                    if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == expr.id
                ]
                return bool(values) and all(map(from_maps, values))
            if isinstance(expr, ast.Call):  # a helper returning the lookup (stores_of)
                for helper, given in self._helpers(expr):
                    returns = [r.value for r in _walk(helper) if isinstance(r, ast.Return)]
                    if page_name in given and returns and returns[0] is not None:
                        if all(r is not None and looks_up(r, given[page_name]) for r in returns):
                            return True
            return looks_up(expr, page_name)

        def waits(stmt: ast.AST) -> bool:
            if not isinstance(stmt, ast.For) or m.func_of(stmt) is not closure:
                return False
            var = ast.unparse(stmt.target)
            whole = any(
                _attr(c.func) in WHOLE_WAITS and ast.unparse(c.func.value) == var
                for c in _calls(stmt)
            )
            return whole and from_maps(stmt.iter)

        return _preceded(m, body, waits, closure)

    # ---- 1c, 2a --------------------------------------------------------------------------------
    def _check_submit(self) -> list[tuple]:
        found = []
        m = self.em
        for name in sorted(self.submits):
            submit = self.methods[name]
            calls = [c for c in _calls(submit) if m.func_of(c) is submit]
            record = _record_of(submit)
            if not ast.unparse(record.args[0]).startswith(CURRENT_STREAM):
                found.append((record, "1c", "submit() records the producer off the current stream"))
            producer = ast.unparse(record.func.value)
            chain = list(m.ancestors(record))
            guards = chain[: chain.index(submit)]
            if any(isinstance(a, (ast.For, ast.While)) or _if(a) is False for a in guards):
                found.append(
                    (record, "1c", "submit() records the producer event only on some paths")
                )
            queued = [c for c in calls if producer in map(ast.unparse, _walk_args(c))]
            queued = [c for c in queued if c is not record]
            if not queued or any(_pos(q) < _pos(record) for q in queued):
                found.append(
                    (record, "1c", "submit() must record the producer event, then queue it")
                )
            found += self._check_worker(producer.split(".")[-1])
        return found

    def _worker_tasks(self, producer: str) -> list[tuple[ast.AST, ast.Call]]:
        """(method, call) for each call of a task callable (unpacked with the producer)."""
        out = []
        for f in self.methods.values():
            task = [t for n in _walk(f) if isinstance(n, ast.Assign) for t in n.targets]
            task = [t for t in task if producer in map(ast.unparse, getattr(t, "elts", []))]
            names = {ast.unparse(e) for t in task for e in t.elts} - {producer}
            out += [(f, c) for c in _calls(f) if ast.unparse(c.func) in names]
        return out

    def _check_worker(self, producer: str) -> list[tuple]:
        m, found = self.em, []
        blocks = [
            (w, s) for f in self.methods.values() for w in _walk(f) for s in _stream_blocks(w)
        ]
        waited = {w for w, s in blocks if _stream_waited(m, w, s, ("wait_event",), producer)}
        if not waited:
            found.append(
                (self.engine, "2a", "the worker does not wait on the producer before copying")
            )
        tasks = self._worker_tasks(producer)
        if not tasks:
            found.append((self.engine, "2a", "the worker runs no task unpacked with its producer"))
        for _, c in tasks:
            chain = [c, *m.ancestors(c)]
            cpu = any(_if(a) and chain[i] in a.orelse for i, a in enumerate(chain[1:]))
            if not (cpu or waited & set(chain)):
                found.append((c, "2a", "the worker runs a task outside a stream that waited on it"))
        return found

    # ---- 3c --------------------------------------------------------------------------------
    def _check_mirror(self) -> Iterator[tuple[_Module, tuple]]:
        home, name, method = MIRROR
        classes = self.pkg.classes(home, lambda c: c.name == name)
        if not classes:
            return
        mirrors = _Types(self.pkg, home, {name})
        issues = 0
        for m in self.pkg.modules:
            for c in _calls(m.tree):
                if _attr(c.func) != method or not mirrors.typed(m, c.func.value):
                    continue
                issues += 1
                if not self._issued_reach_the_step(m, c):
                    why = f"the handles {name}.{method}() returns are not the step's {CARRIER}"
                    yield m, (c, "3c", why + ": the worker's forward would not wait for them")
        if not issues:
            why = f"nothing runs {name}.{method}(): a worker replays none of rank 0's copies"
            yield self.pkg.by_rel[home], (classes[0], "3c", why)

    @staticmethod
    def _issued_reach_the_step(m: _Module, issue: ast.Call) -> bool:
        """The issue's result is bound to a name that a later `wait_for=` keyword of a call
        passed to another call holds, in the same function."""
        bound = next((a for a in m.ancestors(issue) if isinstance(a, ast.Assign)), None)
        fn = m.func_of(issue)
        if bound is None or fn is None or not isinstance(bound.targets[0], ast.Name):
            return False
        handles = bound.targets[0].id
        for k in (n for n in _walk(fn) if isinstance(n, ast.keyword) and n.arg == CARRIER):
            step = m.parent.get(k)
            passed = isinstance(m.parent.get(step), ast.Call) and step in m.parent[step].args
            named = isinstance(k.value, ast.Name) and k.value.id == handles
            if passed and named and _pos(step) > _pos(issue):
                return True
        return False

    # ---- 3b --------------------------------------------------------------------------------
    def _forward_names(self) -> set[str]:
        """Functions that run a forward: a graph replay, a bound forward context, or a call of
        such a function (by name, anywhere in the package)."""
        if self._forwards is not None:
            return self._forwards
        names = self._forwards = set()
        while True:
            before = len(names)
            for name, defs in self.pkg.funcs_named.items():
                for _, f in defs:
                    if any(self._is_forward(c, names) for c in _calls(f)) or _binds(f):
                        names.add(name)
            if len(names) == before:
                return names

    @staticmethod
    def _is_forward(call: ast.Call, names: set[str]) -> bool:
        name = _attr(call.func) or getattr(call.func, "id", None)
        return name == "replay" or (name in names and _attr(call.func) is not None)

    @staticmethod
    def _readers(m: _Module) -> list[ast.AST]:
        """The functions of m that read a step's copy handles (`.wait_for`)."""
        reads = [
            n
            for n in _walk(m.tree)
            if isinstance(n, ast.Attribute) and n.attr == CARRIER and isinstance(n.ctx, ast.Load)
        ]
        return list({id(f): f for f in map(m.func_of, reads) if f is not None}.values())

    def _check_consumer(self, m: _Module, fn: ast.AST) -> Iterator[tuple]:
        """3b: every forward fn runs waits on the copy handles it reads."""
        forwards, fields = self._forward_names(), self._context_fields()
        reads = [n for n in _walk(fn) if isinstance(n, ast.Attribute) and n.attr == CARRIER]
        carriers = {ast.unparse(r) for r in reads}
        carriers |= {
            ast.unparse(a.targets[0])
            for a in _walk(fn)
            if isinstance(a, ast.Assign) and ast.unparse(a.value) in carriers
        }

        def waits(stmt: ast.AST) -> bool:
            return isinstance(stmt, ast.For) and _waits_on(stmt, carriers)

        for c in _calls(fn):  # a bound forward context: the bind covers what it runs
            bind = _callee(c) == "bind_forward_context"
            if not (bind or self._is_forward(c, forwards) and not _in_bind(m, c, fn)):
                continue
            if _preceded(m, c, waits, fn) or self._bound_waiting(m, c, fn, carriers, fields):
                continue
            call = ast.unparse(c.func)
            yield c, "3b", f"{call}() runs before waiting on the step's copies (.{CARRIER})"

    def _context_fields(self) -> list[str]:
        ctx = self.pkg.classes("forward_context.py", lambda c: c.name == "ForwardContext")
        body = ctx[0].body if ctx else []
        return [s.target.id for s in body if isinstance(s, ast.AnnAssign)]

    def _bound_waiting(self, m, call, fn, carriers, fields) -> bool:
        """call runs inside `with bind_forward_context(ctx)` whose before_layer waits."""
        for w in (a for a in m.ancestors(call) if isinstance(a, ast.With)):
            for item in w.items:
                e = item.context_expr
                if not (isinstance(e, ast.Call) and _callee(e) == "bind_forward_context"):
                    continue
                ctx = e.args[0] if e.args else None
                if isinstance(ctx, ast.Name):
                    values = [
                        a.value
                        for a in _walk(fn)
                        if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == ctx.id
                    ]
                    ctx = values[-1] if len(values) == 1 else None
                if isinstance(ctx, ast.Call) and _callee(ctx) == "ForwardContext":
                    at = fields.index(HOOK) if HOOK in fields else -1
                    hook = _arg(ctx, at, HOOK)
                    hook = hook.body if isinstance(hook, ast.IfExp) else hook
                    if hook is not None and _waits_on(hook, carriers):
                        return True
        return False

    def _check_layers(self, m: _Module) -> Iterator[tuple]:
        """A layer calls the forward context's before_layer before reading its KV caches."""
        for node in _walk(m.tree):
            if not (isinstance(node, ast.Attribute) and node.attr == "kv_caches"):
                continue
            fn = m.func_of(node)
            ctx = ast.unparse(node.value)
            got = fn and any(
                isinstance(a, ast.Assign)
                and ast.unparse(a.targets[0]) == ctx
                and _callee(a.value) == "get_forward_context"
                for a in _walk(fn)
            )
            if not got:
                continue
            hook = f"{ctx}.{HOOK}"

            def hooked(stmt: ast.AST, hook: str = hook) -> bool:  # calls it, or does if it is set
                if isinstance(stmt, ast.If) and hook in ast.unparse(stmt.test):
                    return any(map(hooked, stmt.body))
                call = stmt.value if isinstance(stmt, ast.Expr) else None
                return isinstance(call, ast.Call) and ast.unparse(call.func) == hook

            if not _preceded(m, node, hooked, fn):
                yield node, "3b", f"KV caches read before {ctx}.{HOOK}(): loads may be in flight"

    # ---- 6a --------------------------------------------------------------------------------
    def _pauses(self) -> dict[str, str]:
        """CopyEngine contextmanagers that raise a flag: method name -> flag attribute."""
        out = {}
        for name, f in self.methods.items():
            if not any(ast.unparse(d).endswith("contextmanager") for d in f.decorator_list):
                continue
            for a in (n for n in _walk(f) if isinstance(n, ast.Assign)):
                t = a.targets[0]
                if isinstance(t, ast.Attribute) and _is_self(t.value) and _is_true(a.value):
                    out[name] = t.attr
        return out

    def _check_pause(self) -> list[tuple]:
        pauses, found = self._pauses(), []
        if not pauses:
            return [(self.engine, "6a", "CopyEngine has no pause for graph captures")]
        for _, flag in pauses.items():
            for f, c in self._worker_tasks(self.producer):
                loops = [
                    w
                    for w in _walk(f)
                    if isinstance(w, ast.While) and f"self.{flag}" in ast.unparse(w.test)
                ]
                if not any(_pos(w) < _pos(c) for w in loops):
                    why = f"the worker runs a task without waiting while self.{flag} is up"
                    found.append((c, "6a", why))
        return found

    def _check_capture(self, m: _Module) -> Iterator[tuple[_Module, tuple]]:
        """6a for each CUDA-graph capture in m."""
        guards: dict[ast.ClassDef, set[str]] = {}
        for site in (n for n in _walk(m.tree) if _captures(n)):
            cls, fn = m.class_of(site), m.func_of(site)
            guard = _guarded_by(m, site)
            if guard is None and cls is not None and fn is not None:  # guarded by its callers
                uses = [
                    n
                    for n in _walk(cls)
                    if isinstance(n, ast.Attribute) and n.attr == fn.name and _is_self(n.value)
                ]
                callers = {_guarded_by(m, u) for u in uses}
                guard = callers.pop() if len(callers) == 1 else None
            if guard is None or cls is None:
                yield m, (site, "6a", "a CUDA graph is captured outside the capture guard")
            else:
                guards.setdefault(cls, set()).add(guard)
        for cls, names in guards.items():
            yield from self._check_guard_source(m, cls, names)

    def _check_guard_source(self, m: _Module, cls: ast.ClassDef, guards: set[str]):
        """Each guard comes from a constructor argument, and every construction of the class
        passes a CopyEngine's pause there."""
        pauses = self._pauses()
        init = next((f for f in cls.body if isinstance(f, DEFS) and f.name == "__init__"), None)
        params = [a.arg for a in init.args.posonlyargs + init.args.args] if init else []
        for guard in sorted(guards):
            sources = [
                a.value
                for a in _walk(init or cls)
                if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == f"self.{guard}"
            ]
            names = {n.id for v in sources for n in _walk(v) if isinstance(n, ast.Name)}
            given = [p for p in params if p in names]
            if not given:
                why = f"the capture guard self.{guard} is not taken from the constructor"
                yield m, (cls, "6a", why)
                continue
            at = params.index(given[0]) - 1
            for mod in self.pkg.modules:
                for node, _ in self.pkg.refs(mod, m.rel, {cls.name}):
                    call = mod.parent.get(node)
                    if isinstance(call, ast.Call) and call.func is node:
                        if not self._is_pause(mod, _arg(call, at, given[0]), pauses):
                            why = f"{cls.name} built without a CopyEngine pause as capture guard"
                            yield mod, (call, "6a", why)

    def _is_pause(self, m: _Module, value: ast.AST | None, pauses: dict[str, str]) -> bool:
        """value is `<a CopyEngine>.<pause>`, or that if something holds and else None. A
        CopyEngine that is a parameter of the function building the class counts only if
        every call of that function passes one there (or one if something holds, else
        None): a builder shared by several callers is checked at each of them."""
        if isinstance(value, ast.IfExp):
            branches = [value.body, value.orelse]
            nones = [b for b in branches if isinstance(b, ast.Constant) and b.value is None]
            return len(nones) == 1 and any(self._is_pause(m, b, pauses) for b in branches)
        if not (
            isinstance(value, ast.Attribute)
            and value.attr in pauses
            and self.engines.typed(m, value.value)
        ):
            return False
        fn = m.func_of(value)
        if not isinstance(value.value, ast.Name) or not isinstance(fn, DEFS):
            return True
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        if value.value.id not in params:
            return True
        at = params.index(value.value.id) - (1 if m.class_of(fn) is not None else 0)
        calls = [
            (mod, call)
            for mod in self.pkg.modules
            for node, _ in self.pkg.refs(mod, m.rel, {fn.name})
            if isinstance(call := mod.parent.get(node), ast.Call) and call.func is node
        ]
        return bool(calls) and all(
            self._passes_engine(mod, _arg(call, at, value.value.id)) for mod, call in calls
        )

    def _passes_engine(self, m: _Module, value: ast.AST | None, depth: int = 0) -> bool:
        """value is a CopyEngine, or one if something holds and else None. A parameter of
        the function it is passed from counts only if every call of that function passes
        one there in turn (a builder that hands its copies on, as build_runner does)."""
        if isinstance(value, ast.IfExp):
            branches = [value.body, value.orelse]
            nones = [b for b in branches if isinstance(b, ast.Constant) and b.value is None]
            return len(nones) == 1 and any(self.engines.typed(m, b) for b in branches)
        if value is None or not self.engines.typed(m, value):
            return False
        fn = m.func_of(value)
        if depth >= 4 or not isinstance(value, ast.Name) or not isinstance(fn, DEFS):
            return True
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        if value.id not in params:
            return True
        at = params.index(value.id) - (1 if m.class_of(fn) is not None else 0)
        calls = [
            (mod, call)
            for mod in self.pkg.modules
            for node, _ in self.pkg.refs(mod, m.rel, {fn.name})
            if isinstance(call := mod.parent.get(node), ast.Call) and call.func is node
        ]
        return all(
            self._passes_engine(mod, _arg(call, at, value.id), depth + 1) for mod, call in calls
        )


def _captures(node: ast.AST) -> bool:
    """node starts a CUDA-graph capture: `with torch.cuda.graph(...)`, capture_begin()."""
    if isinstance(node, ast.With):
        return any(
            ast.unparse(getattr(i.context_expr, "func", i.context_expr)).endswith(
                ("cuda.graph", "cuda.graphs.graph")
            )
            for i in node.items
        )
    return _callee(node) in ("capture_begin", "make_graphed_callables")


def _pool_copy(m: _Module, node: ast.AST, pool, tier: bool) -> str | None:
    """What node does to a pool tensor (pool(expr) says if expr is one) that only page_copies
    may do; in the tier's own code (tier), any copy call. None: nothing of the kind."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        into = [
            s.value
            for t in _targets(node)
            for s in _walk(t)
            if isinstance(s, ast.Subscript) and isinstance(s.ctx, ast.Store) and pool(s.value)
        ]
        return f"assignment into a pool tensor ({ast.unparse(into[0])})" if into else None
    if not isinstance(node, ast.Call):
        return None
    name = _attr(node.func)
    receiver = node.func.value if name else None
    blocking = not any(k.arg == "non_blocking" for k in node.keywords)
    if any(k.arg == "out" and pool(k.value) for k in node.keywords):
        return "a pool tensor given as out="
    if name in COPY_METHODS and pool(receiver):
        return f".{name}() into a pool tensor"
    if name in COPY_METHODS | TRANSFERS and (pool(receiver) or any(map(pool, _args(node)))):
        if not (name in READS and blocking and pool(receiver)):
            return f".{name}() of a pool tensor"
        if not _preceded(m, node, _is_sync):  # a blocking read into a new tensor
            return f"blocking .{name}() read of a pool tensor before a .synchronize()"
        return None
    if tier and (name in COPY_METHODS | TRANSFERS - {"cpu"} or not blocking):
        return f"{ast.unparse(node.func)}() copies in the tier's code"
    return None


def _guarded_by(m: _Module, node: ast.AST) -> str | None:
    """The `self.<guard>` of a `with self.<guard>():` around node in its function."""
    fn = m.func_of(node)
    for a in m.ancestors(node):
        if a is fn:
            return None
        if isinstance(a, ast.With):
            for i in a.items:
                e = i.context_expr
                if isinstance(e, ast.Call) and not e.args and isinstance(e.func, ast.Attribute):
                    if _is_self(e.func.value):
                        return e.func.attr
    return None


def _check_streams(m: _Module) -> Iterator[tuple]:
    """2b: every side-stream block that issues work waits on something first."""
    for node in _walk(m.tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("cuda.set_stream"):
            yield node, "2b", "torch.cuda.set_stream: use `with torch.cuda.stream(s)`"
        for stream in _stream_blocks(node):
            if not _stream_waited(m, node, stream, ("wait_event", "wait_stream")):
                yield node, "2b", f"work on stream {stream} before {stream}.wait_event/wait_stream"


def _stream_blocks(node: ast.AST) -> Iterator[str]:
    """The streams a `with torch.cuda.stream(S):` block that calls anything switches to."""
    if isinstance(node, (ast.With, ast.AsyncWith)) and any(map(_calls, node.body)):
        for ctx in (item.context_expr for item in node.items):
            if isinstance(ctx, ast.Call) and ast.unparse(ctx.func) in STREAM_CTX:
                yield ast.unparse([*ctx.args, *(k.value for k in ctx.keywords), ctx][0])


def _stream_waited(m: _Module, target: ast.AST, stream: str, waits: tuple, arg=None) -> bool:
    """A `stream.<wait>(arg)` statement runs before target on every path of its function,
    unconditionally."""

    def is_wait(stmt: ast.AST) -> bool:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and _attr(call.func) in waits):
            return False
        given = ast.unparse(call.args[0]) if call.args else ""
        return ast.unparse(call.func.value) == stream and arg in (None, given, given.split(".")[-1])

    return _preceded(m, target, is_wait)


def _preceded(m: _Module, target: ast.AST, ok, scope: ast.AST | None = None) -> bool:
    """A statement satisfying ok runs before target on every path of target's function (or
    of scope): it precedes target, or a block holding target, in the same statement list."""
    scope = scope or m.func_of(target) or m.tree
    chain = [target, *m.ancestors(target)]
    for node in chain[: chain.index(scope)] if scope in chain else []:
        for block in (getattr(m.parent[node], f, None) for f in ("body", "orelse", "finalbody")):
            ids = [id(s) for s in block] if isinstance(block, list) else []
            if id(node) in ids and any(map(ok, block[: ids.index(id(node))])):
                return True
    return False


def _waits_on(node: ast.AST, carriers: set[str]) -> bool:
    """node loops (for or comprehension) over a carrier of copy handles and waits on each."""
    loops = [
        n
        for n in _walk(node)
        if isinstance(n, (ast.For, ast.comprehension)) and ast.unparse(n.iter) in carriers
    ]
    for loop in loops:
        var = ast.unparse(loop.target)
        scope = node if isinstance(loop, ast.comprehension) else loop
        if any(
            _attr(c.func) in CONSUMER_WAITS and ast.unparse(c.func.value) == var
            for c in _calls(scope)
        ):
            return True
    return False


def _binds(fn: ast.AST) -> bool:
    return any(
        any(_callee(i.context_expr) == "bind_forward_context" for i in w.items)
        for w in _walk_of(fn, (ast.With,))
    )


def _in_bind(m: _Module, node: ast.AST, fn: ast.AST) -> bool:
    for a in m.ancestors(node):
        if a is fn:
            return False
        if isinstance(a, ast.With) and any(
            _callee(i.context_expr) == "bind_forward_context" for i in a.items
        ):
            return True
    return False


def _conditional(m: _Module, node: ast.AST, fn: ast.AST) -> bool:
    """node runs on some paths of fn only: under an if, a loop, a try or a short circuit."""
    branches = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.BoolOp, ast.comprehension)
    for a in m.ancestors(node):
        if a is fn:
            return False
        if isinstance(a, branches):
            return True
    return False


def _is_sync(stmt: ast.AST) -> bool:
    return isinstance(stmt, ast.Expr) and _callee(stmt.value) == "synchronize"


def _bind(scope: ast.AST, names: set[str], is_value) -> set[str]:
    """names, plus the names in scope bound (fixpoint) to a value is_value(value, names)."""
    names = set(names)
    while True:
        before = len(names)
        for node in _walk_of(scope, BINDINGS):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value:
                pairs = [(t, node.value) for t in _targets(node)]
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                pairs = [(node.optional_vars, node.context_expr)]
            else:
                continue
            names |= {n for t, v in pairs for n in _bound(t, v, names, is_value)}
        if len(names) == before:
            return names


def _bound(target: ast.AST, value: ast.AST, names: set[str], is_value) -> Iterator[str]:
    target = target.value if isinstance(target, ast.Starred) else target
    if isinstance(target, (ast.Tuple, ast.List)):
        paired = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
        for i, t in enumerate(target.elts):
            yield from _bound(t, value.elts[i] if paired else value, names, is_value)
    elif isinstance(target, ast.Name) and is_value(value, names):
        yield target.id


def _recording_maps(fn: ast.AST, handle: str, pages: str) -> set[str]:
    """Maps `self.<M>` that fn stores `handle` in under each of `pages`, in a loop over
    them (`for p in pages: self.M[p] = handle`)."""
    found = set()
    for loop in _walk(fn):
        if isinstance(loop, ast.For) and ast.unparse(loop.iter) == pages:
            key = ast.unparse(loop.target)
            for a in (s for s in _walk(loop) if isinstance(s, ast.Assign)):
                t = a.targets[0]
                if isinstance(t, ast.Subscript) and ast.unparse(a.value) == handle:
                    if ast.unparse(t.slice) == key and isinstance(t.value, ast.Attribute):
                        found.add(t.value.attr)
    return found


def _copying_functions(m: _Module) -> dict[str, ast.AST]:
    """Top-level functions of m that issue a copy, directly or through another such one."""
    funcs = {f.name: f for f in m.tree.body if isinstance(f, DEFS)}
    copying: dict[str, ast.AST] = {}
    while True:
        before = len(copying)
        for name, f in funcs.items():
            if any(_copies(node, copying) for node in _walk(f)):
                copying[name] = f
        if len(copying) == before:
            return copying


def _copies(node: ast.AST, copying: dict[str, ast.AST]) -> bool:
    """node copies: a copy method, a non_blocking transfer, a subscript assignment, or a
    call of a function in `copying`."""
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        return any(isinstance(t, ast.Subscript) for t in _targets(node))
    if not isinstance(node, ast.Call):
        return False
    return (
        _attr(node.func) in COPY_METHODS
        or any(k.arg == "non_blocking" for k in node.keywords)
        or getattr(node.func, "id", None) in copying
    )


def _tensor_attrs(cls: ast.ClassDef) -> set[str]:
    """Attributes a class sets to a tensor it allocates (`self.kv = torch.zeros(...)`, or
    `self.kv = host_empty(...)`: the host pools' pinned allocation, kv/pinned.py)."""
    return {
        t.attr
        for a in _walk(cls)
        if isinstance(a, (ast.Assign, ast.AnnAssign))
        and isinstance(a.value, ast.Call)
        and _allocates(a.value.func)
        for t in _targets(a)
        if isinstance(t, ast.Attribute) and _is_self(t.value)
    }


def _allocates(func: ast.AST) -> bool:
    if isinstance(func, ast.Name):
        return func.id in POOL_ALLOCATORS
    return _attr(func) in FACTORIES and ast.unparse(func.value) == "torch"


def _record_of(fn: ast.AST) -> ast.Call | None:
    """The first `<event>.record(<stream>)` call made by fn itself."""
    calls = [c for c in _calls(fn) if _attr(c.func) == "record" and c.args]
    return min(calls, key=_pos) if calls else None


def _records(fn: ast.AST) -> bool:
    return _record_of(fn) is not None


def _queues(fn: ast.AST) -> bool:
    return any(_attr(c.func) in ("put", "put_nowait", "append") for c in _calls(fn))


def _if(node: ast.AST) -> bool | None:
    """For an `if`, whether it tests for a CUDA device (`if self.cuda:`, `device.type ==
    "cuda"`, `torch.cuda.is_available()`); None for other nodes."""
    if not isinstance(node, ast.If):
        return None
    test = node.test
    if isinstance(test, ast.Attribute):
        return test.attr in ("cuda", "_cuda")
    if isinstance(test, ast.Call):
        return ast.unparse(test.func).endswith("cuda.is_available")
    if isinstance(test, ast.Compare) and len(test.comparators) == 1:
        sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
        return "'cuda'" in sides and any(x.endswith(".type") for x in sides)
    return False


def _calls(node: ast.AST | None) -> list[ast.Call]:
    return _walk_of(node, (ast.Call,)) if node is not None else []


def _targets(node: ast.AST) -> list[ast.AST]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _callee(call: ast.AST) -> str | None:
    if not isinstance(call, ast.Call):
        return None
    return _attr(call.func) or getattr(call.func, "id", None)


def _attr(func: ast.AST) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _args(call: ast.Call) -> list[ast.AST]:
    return [*call.args, *(k.value for k in call.keywords)]


def _walk_args(call: ast.Call) -> Iterator[ast.AST]:
    for a in _args(call):
        yield from _walk(a)


def _arg(call: ast.Call, at: int, name: str) -> ast.AST | None:
    """The argument at position `at` or keyword `name`."""
    kw = next((k.value for k in call.keywords if k.arg == name), None)
    return kw if kw is not None else (call.args[at] if 0 <= at < len(call.args) else None)


def _pos(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _resolve(node: ast.ImportFrom, package: list[str]) -> list[str]:
    """Absolute dotted parts of the module a `from` import reads from."""
    base = package[: len(package) - node.level + 1] if node.level else []
    return base + (node.module.split(".") if node.module else [])
