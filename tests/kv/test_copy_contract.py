"""Static check of the copy-ordering contract over the kv package's source.

Every copy between device and host pages must go through the one helper that records
the producer event at call time (CopyEngine.submit): the copy bodies live in
page_copies.py and are only ever called from inside a closure handed to a submit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen.kv

KV_DIR = Path(batchgen.kv.__file__).parent
COPY_BODIES = {
    node.name
    for node in ast.parse((KV_DIR / "page_copies.py").read_text()).body
    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
}
COPY_CALLS = {"copy_", "index_copy_", "to", "cpu", "cuda", "pin_memory"}


def _parents(tree):
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _is_submit(node) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "attr", "").endswith("submit")


def _submitted(node, parents, tree) -> bool:
    """True when `node` sits in a lambda passed to a *submit(...) call, or in a nested
    def whose name is passed to one."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Lambda) and _is_submit(parents.get(node)):
            return True
        if isinstance(node, ast.FunctionDef):
            uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == node.name]
            if any(_is_submit(parents.get(u)) for u in uses):
                return True
    return False


def test_copy_bodies_are_only_called_inside_submitted_closures():
    assert {"device_to_host_pages", "host_to_device_pages"} <= COPY_BODIES
    calls = 0
    for path in KV_DIR.glob("*.py"):
        if path.name == "page_copies.py":
            continue
        tree = ast.parse(path.read_text())
        parents = _parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in COPY_BODIES:
                calls += 1
                assert _submitted(node, parents, tree), (
                    f"{path.name}:{node.lineno} calls {node.func.id} outside a submitted copy"
                )
    assert calls >= 3


def test_no_other_kv_module_issues_copies_or_touches_streams():
    allowed = {
        "page_copies.py": None,  # the copy bodies themselves
        "copy_engine.py": {"record", "wait_event"},  # the helper
    }
    for path in KV_DIR.glob("*.py"):
        if path.name in allowed:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in {"Stream", "stream"}:
                raise AssertionError(f"{path.name}:{node.lineno} uses CUDA streams directly")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name in COPY_CALLS - {"cpu"} and name != "to":
                    raise AssertionError(f"{path.name}:{node.lineno} calls .{name}(...)")
                if name == "to" and any(k.arg == "non_blocking" for k in node.keywords):
                    raise AssertionError(f"{path.name}:{node.lineno} issues an async copy")


def test_submit_records_the_producer_event_on_the_current_stream_at_call_time():
    tree = ast.parse((KV_DIR / "copy_engine.py").read_text())
    submit = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "submit"
    )
    src = ast.unparse(submit)
    assert "record(torch.cuda.current_stream(" in src
    assert "q.put(" in src
    record = src.index("record(torch.cuda.current_stream(")
    assert record < src.index("q.put("), "the event must be recorded before queueing"
    assert "handle" not in src.split("record(")[0].split("if self.cuda")[-1]
    run = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_run")
    body = ast.unparse(run)
    assert body.index("stream.wait_event(producer)") < body.index("copy(handle)"), (
        "the copy stream must wait for the producer before copying"
    )
