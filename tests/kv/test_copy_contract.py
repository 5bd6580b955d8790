"""The copy-ordering contract checker (scripts/hygiene/copy_contract.py) on mutated copies
of the package: each mutation breaks the contract the way a real change could, and the
checker must name the rule it breaks; the real tree must pass.

Every mutation edits a copy of src/batchgen in a temporary folder, never the source.
Mutations find their place through the AST (a function by name, a call by what it calls),
then edit the text with replacements that must match exactly once, so a refactor that
moves a target makes the test fail loudly instead of mutating nothing.
"""

from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path
from textwrap import dedent, indent

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from hygiene.copy_contract import check_copy_contract  # noqa: E402


class Source:
    """One file of the copied package, edited by checked replacements."""

    def __init__(self, root: Path, rel: str) -> None:
        self.path, self.rel = root / rel, rel
        assert self.path.is_file(), f"mutation target {rel} is gone"
        self.text = self.path.read_text()
        self.tree = ast.parse(self.text)

    def replace(self, old: str, new: str) -> None:
        count = self.text.count(old)
        assert count == 1, f"{self.rel}: expected exactly one {old!r}, found {count}"
        self._write(self.text.replace(old, new), new)

    def replace_in(self, node: ast.AST, old: str, new: str) -> None:
        """Replace old, which must occur once in node's source, there only."""
        seg = self.segment(node)
        assert seg.count(old) == 1, f"{self.rel}: expected one {old!r} in {seg!r}"
        self.replace(seg, seg.replace(old, new))

    def _write(self, text: str, new: str) -> None:
        assert text != self.text and new in text, f"{self.rel}: the mutation changed nothing"
        self.text, self.tree = text, ast.parse(text)
        self.path.write_text(text)

    def func(self, name: str, tree: ast.AST | None = None) -> ast.FunctionDef:
        found = [n for n in ast.walk(tree or self.tree) if getattr(n, "name", None) == name]
        found = [n for n in found if isinstance(n, ast.FunctionDef)]
        assert len(found) == 1, f"{self.rel}: expected one def {name}, found {len(found)}"
        return found[0]

    def cls(self, name: str) -> ast.ClassDef:
        return self.only(self.tree, f"class {name}", lambda n: is_class(n, name))

    def only(self, scope: ast.AST, what: str, pred) -> ast.AST:
        found = [n for n in ast.walk(scope) if pred(n)]
        assert len(found) == 1, f"{self.rel}: expected one {what}, found {len(found)}"
        return found[0]

    def segment(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.text, node)

    def lines(self, stmt: ast.AST) -> str:
        return "".join(self.text.splitlines(True)[stmt.lineno - 1 : stmt.end_lineno])

    def statement(self, body_owner: ast.AST, node: ast.AST) -> ast.stmt:
        """The statement of body_owner.body that holds node."""
        return next(s for s in body_owner.body if any(n is node for n in ast.walk(s)))

    def insert_before(self, stmt: ast.stmt, code: str, after: bool = False) -> None:
        """Insert code, indented like stmt, on the line before (or after) it."""
        lines = self.text.splitlines(True)
        first = lines[stmt.lineno - 1]
        block = indent(dedent(code), first[: len(first) - len(first.lstrip())])
        at = stmt.end_lineno if after else stmt.lineno - 1
        assert block not in self.text
        self._write("".join(lines[:at]) + block + "".join(lines[at:]), block)

    def insert_after(self, stmt: ast.stmt, code: str) -> None:
        self.insert_before(stmt, code, after=True)

    def insert_at_top(self, fn: ast.FunctionDef, code: str) -> None:
        body = fn.body[1:] if ast.get_docstring(fn) else fn.body
        self.insert_before(body[0], code)

    def delete(self, stmt: ast.stmt, within: ast.AST | None = None) -> None:
        """Replace a statement by `pass` (its block keeps a body); `within`: a def whose
        text holds the statement's once, where the file holds it more than once."""
        old = self.lines(stmt)
        new = old[: len(old) - len(old.lstrip())] + "pass\n"
        if within is None:
            self.replace(old, new)
        else:
            self.replace_in(within, old.strip(), new.strip())

    def append(self, code: str) -> None:
        self._write(self.text + "\n\n" + dedent(code), dedent(code))


def is_class(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.ClassDef) and node.name == name


def callee(node: ast.AST) -> str:
    if not isinstance(node, ast.Call):
        return ""
    return getattr(node.func, "attr", None) or getattr(node.func, "id", "")


def calling(name: str):
    return lambda n: callee(n) == name


def copy_call(prefix: str):
    return lambda n: callee(n).startswith(prefix)


def submitted_closure(src: Source, fn: ast.FunctionDef, body_prefix: str) -> ast.AST:
    """The closure fn hands to a submit that runs a copy body named body_prefix*."""
    body = src.only(fn, f"{body_prefix}* call", copy_call(body_prefix))
    for node in ast.walk(fn):
        if isinstance(node, (ast.Lambda, ast.FunctionDef)) and node is not fn:
            if any(n is body for n in ast.walk(node)):
                return node
    raise AssertionError(f"{src.rel}: no closure around {body_prefix}* in {fn.name}")


def hoist(src: Source, fn: ast.FunctionDef, call: ast.Call) -> None:
    """Run `call` synchronously in fn, just before the statement holding it: `kept = call`."""
    stmt = src.statement(fn, call)
    old, seg = src.lines(stmt), src.segment(call)
    assert old.count(seg) == 1
    pad = old[: len(old) - len(old.lstrip())]
    src.replace(old, f"{pad}kept = {seg}\n" + old.replace(seg, "kept"))


LEDGER = "kv/copy_ledger.py"  # CopyLedger.store / .load: the one executor of copy records


def load_closure(src: Source) -> ast.FunctionDef:
    """The closure CopyLedger.load submits (pages and state slots alike)."""
    closure = submitted_closure(src, src.func("load"), "host_to_device_pages")
    assert isinstance(closure, ast.FunctionDef), "CopyLedger.load no longer submits a def"
    return closure


def load_closure_waits(src: Source) -> list[ast.For]:
    """The loops of the ledger's load closure that wait before the copy body."""
    return [s for s in load_closure(src).body if isinstance(s, ast.For)]


def store_before_load_wait(src: Source) -> ast.For:
    waits = [
        s
        for s in load_closure_waits(src)
        if any(callee(n) == "wait_on_current_stream" for n in ast.walk(s))
    ]
    assert len(waits) == 1, f"expected one whole-store wait in the load closure: {waits}"
    return waits[0]


def stream_waits(src: Source, scope: ast.AST) -> list[ast.stmt]:
    """Statements `S.wait_*(...)` in scope (or the `if` guarding one) on a stream S that a
    `with torch.cuda.stream(S)` uses."""
    streams = {
        src.segment(item.context_expr.args[0])
        for n in ast.walk(scope)
        if isinstance(n, ast.With)
        for item in n.items
        if callee(item.context_expr) == "stream"
    }
    waits = [
        n
        for n in ast.walk(scope)
        if isinstance(n, ast.Expr)
        and callee(n.value).startswith("wait_")
        and src.segment(n.value.func.value) in streams
    ]
    guards = {
        id(w): g
        for g in ast.walk(scope)
        if isinstance(g, ast.If) and len(g.body) == 1
        for w in waits
        if g.body[0] is w
    }
    return [guards.get(id(w), w) for w in waits]


# --- 1a: copy bodies run only in closures handed to CopyEngine.submit -------------------


def sync_store_with_noop_closure(root):
    src = Source(root, LEDGER)
    fn = src.func("store")
    hoist(src, fn, src.only(fn, "device_to_host_pages call", calling("device_to_host_pages")))


def sync_staged_store_with_noop_closure(root):
    src = Source(root, LEDGER)
    fn = src.func("store")
    hoist(src, fn, src.only(fn, "device_to_host_staged call", calling("device_to_host_staged")))


def sync_load_with_noop_closure(root):
    src = Source(root, LEDGER)
    fn = src.func("load")
    hoist(src, fn, src.only(fn, "host_to_device_pages call", calling("host_to_device_pages")))


def sync_layer_store_with_noop_closure(root):
    # the page tier's per-layer store copying its layer itself instead of handing the
    # record to the ledger
    src = Source(root, "kv/tiered.py")
    fn = src.func("store_layer")
    ledger = src.only(fn, "ledger.store(...)", calling("store"))
    src.insert_before(
        src.statement(fn, ledger),
        """\
        from batchgen.kv.page_copies import device_to_host_pages
        layer_copy = device_to_host_pages(
            self.device_pool.kv, self.host_pool.kv, dev_pages, host_pages, range(layer, layer + 1)
        )
        """,
    )


def closure_reference_instead_of_call(root):
    src = Source(root, LEDGER)
    fn = src.func("store")
    closure = submitted_closure(src, fn, "device_to_host_pages")
    call = src.only(closure, "device_to_host_pages call", calling("device_to_host_pages"))
    submit = src.only(fn, "submit(...)", calling("submit"))
    handed = [a for a in submit.args if src.segment(a) == closure.name]
    assert len(handed) == 1, "CopyLedger.store no longer hands its closure to submit"
    args = ", ".join(map(src.segment, call.args))
    src.replace_in(
        submit,
        f" {closure.name},",
        f" functools.partial({src.segment(call.func)}, {args}),",
    )


def submitted_closure_also_called(root):
    src = Source(root, LEDGER)
    closure = load_closure(src)
    src.insert_after(closure, f"{closure.name}(None)\n")


def closure_handed_to_another_executor(root):
    src = Source(root, LEDGER)
    fn = src.func("store")
    submit = src.only(fn, "submit(...)", calling("submit"))
    src.replace_in(submit, src.segment(submit.func), "futures.ThreadPoolExecutor(1).submit")


def submit_runs_the_copy_it_is_given(root):
    src = Source(root, "kv/copy_engine.py")
    submit = src.func("submit")
    put = src.only(submit, "q.put(...)", calling("put"))
    src.insert_before(src.statement(submit, put), "handle.keep = (copy(handle), 'run at once')\n")


def copy_body_through_its_module(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_store"),
        """\
        from batchgen.kv import page_copies
        page_copies.device_to_host_pages(self.device_pool.kv, self.host_pool.kv, [0], [0])
        """,
    )


def copy_body_through_a_module_alias(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_load"),
        """\
        import batchgen.kv.page_copies as pc
        pc.host_to_device_pages(self.host_pool.kv, self.device_pool.kv, q.host_pages, q.dev_pages)
        """,
    )


def copy_body_through_a_relative_name_alias(root):
    src = Source(root, "kv/kv_manager.py")
    src.insert_at_top(
        src.func("swap_out"),
        """\
        from .page_copies import device_to_host_pages as gather
        gather(self.tier.device_pool.kv, self.tier.host_pool.kv, [0], [0])
        """,
    )


def copy_body_by_dotted_path_outside_kv(root):
    src = Source(root, "engine/builder.py")
    src.insert_at_top(
        src.func("build_tier"),
        """\
        import batchgen.kv.page_copies
        batchgen.kv.page_copies.device_to_host_pages(self.pool.kv, None, [0], [0])
        """,
    )


def copy_body_without_a_direction(root):
    Source(root, "kv/page_copies.py").append(
        """\
        def move_pages(src, dst, pages):
            dst[:, pages].copy_(src[:, pages], non_blocking=True)
        """
    )


def _in_gather(root, code: str) -> None:
    """Insert `code` into gather_pages, before its return."""
    src = Source(root, "kv/page_copies.py")
    fn = src.func("gather_pages")
    ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return))
    src.insert_before(ret, code)


def gather_that_copies_to_the_host(root):
    _in_gather(root, "torch.empty(1).copy_(idx[:1].float(), non_blocking=True)\n")


def gather_that_moves_its_pages_to_the_host(root):
    _in_gather(root, 'dev_kv.to("cpu", non_blocking=True)\n')


def gather_with_a_pageable_index(root):
    src = Source(root, "kv/page_copies.py")
    fn = src.func("gather_pages")
    src.replace_in(
        fn,
        "to_device(torch.tensor(dev_pages, dtype=torch.int64), dev_kv.device)",
        "torch.tensor(dev_pages, dtype=torch.int64).to(dev_kv.device, non_blocking=True)",
    )


def gather_through_a_copy_body(root):
    _in_gather(root, "_device_to_host_runs(dev_kv, dev_kv, host_pages, range(1))\n")


# --- 1b: nothing else copies between pools ----------------------------------------------


def slice_assignment_between_pools(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_store"),
        "self.host_pool.kv[:, 0] = self.device_pool.kv[:, :, q.dev_pages[0]].cpu()\n",
    )


def slice_assignment_through_a_local(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_store"),
        """\
        pinned = self.host_pool.kv
        pinned[:, 0] = 0
        """,
    )


def slice_assignment_into_a_host_page_view(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_load"),
        """\
        view = self.host_pool.page(q.host_pages[0])
        view[:] = 0
        """,
    )


def blocking_to_cpu(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_store"), "staged = self.device_pool.kv[:, :, q.dev_pages].to('cpu')\n"
    )


def blocking_copy_between_pools(root):
    src = Source(root, "kv/tiered.py")
    src.insert_at_top(
        src.func("_submit_load"),
        "self.device_pool.kv[0, :, 0].copy_(self.host_pool.kv[0, 0].to(self.device_pool.kv.device))\n",
    )


def copy_into_host_pool_from_the_engine(root):
    src = Source(root, "engine/builder.py")
    fn = src.func("build_tier")
    made = src.only(fn, "TieredKVManager(...)", calling("TieredKVManager"))
    src.insert_after(
        src.statement(fn, made), "tier.host_pool.kv[:, 0].copy_(self.pool.kv[:, :, 0])\n"
    )


def write_into_device_pool_from_another_kv_module(root):
    src = Source(root, "kv/kv_manager.py")
    src.insert_at_top(src.func("_evicted"), "self.tier.device_pool.kv[:, :, page] = 0\n")


def readback_before_the_store_completes(root):
    src = Source(root, "kv/copy_readback.py")
    fn = src.func("readback_pages")
    sync = src.only(fn, "synchronize()", calling("synchronize"))
    src.delete(src.statement(fn, sync), within=fn)


def state_readback_before_its_store_completes(root):
    src = Source(root, "kv/copy_readback.py")
    fn = src.func("readback_slot")
    sync = src.only(fn, "synchronize()", calling("synchronize"))
    src.delete(src.statement(fn, sync), within=fn)


# --- 2a: nothing replaces the engine's producer wait ------------------------------------


def engine_subclass_that_skips_the_wait(root):
    Source(root, "kv/copy_engine.py").append(
        """\
        class FastCopyEngine(CopyEngine):
            def _issue(self, task, inline=False):
                handle, producer, copy, stream = task
                with torch.cuda.stream(stream):
                    handle.keep = (copy(handle),)
        """
    )


def engine_subclass_under_another_name(root):
    Source(root, "runner/staging.py").append(
        """\
        from batchgen.kv.copy_engine import CopyEngine as Copies


        class _Unordered(Copies):
            pass
        """
    )


def engine_method_replaced_on_an_instance(root):
    Source(root, "runner/staging.py").append(
        """\
        from batchgen.kv.copy_engine import CopyEngine


        def _unordered(copies: CopyEngine) -> None:
            copies._issue = lambda task, inline=False: None
        """
    )


def engine_method_replaced_through_setattr(root):
    Source(root, "runner/staging.py").append(
        """\
        from batchgen.kv import copy_engine


        def _unordered() -> None:
            setattr(copy_engine.CopyEngine, "submit", None)
        """
    )


def worker_wait_made_conditional(root):
    src = Source(root, "kv/copy_engine.py")
    (wait,) = stream_waits(src, src.cls("CopyEngine"))
    old = src.lines(wait)
    pad = old[: len(old) - len(old.lstrip())]
    src.replace(old, f"{pad}if self.background:\n    {old}")


# --- 2b: a side stream waits before it works --------------------------------------------


def side_stream_copy_without_wait(root):
    Source(root, "runner/staging.py").append(
        """\
        def _side_copy(src, dst):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
        """
    )


def worker_wait_deleted(root):
    src = Source(root, "kv/copy_engine.py")
    waits = stream_waits(src, src.cls("CopyEngine"))
    assert len(waits) == 1, f"expected one wait before the copy stream block, found {len(waits)}"
    src.delete(waits[0])


def graph_capture_wait_deleted(root):
    src = Source(root, "runner/cuda_graphs.py")
    waits = stream_waits(src, src.func("_capture"))
    assert len(waits) == 1, f"expected one wait before the capture stream, found {len(waits)}"
    src.delete(waits[0], within=src.func("_capture"))  # the sampling graphs' capture waits too


# --- 3a: a load waits for the stores of its host pages ----------------------------------


def store_before_load_wait_deleted(root):
    src = Source(root, LEDGER)
    src.delete(store_before_load_wait(src))


def store_before_load_waits_only_for_a_gate(root):
    src = Source(root, LEDGER)
    wait = store_before_load_wait(src)
    old = src.lines(wait)
    src.replace(old, old.replace("wait_on_current_stream()", "wait_layer(0)"))


def load_waits_for_the_stores_of_other_pages(root):
    src = Source(root, LEDGER)
    fn = src.func("load")
    lookup = src.only(fn, "store lookup", calling("stores_of"))
    old = src.segment(lookup)
    src.replace(old, old.replace("host_ids", "dev_ids"))


def layer_store_not_recorded_for_loads(root):
    # a per-layer store (`layers=`) left out of the writing map: only whole stores recorded
    src = Source(root, LEDGER)
    fn = src.func("store")
    record = src.statement(fn, src.only(fn, "record_store(...)", calling("record_store")))
    old = src.lines(record)
    pad = old[: len(old) - len(old.lstrip())]
    src.replace(old, f"{pad}if layers is None:\n    {old}")


def state_load_without_store_wait(root):
    # the state slots' path of the load closure runs before the store-before-load wait
    src = Source(root, LEDGER)
    closure = load_closure(src)
    (wait,) = [s for s in closure.body if isinstance(s, ast.For)]
    slots = src.only(
        closure,
        "if slots: ... host_to_device_state",
        lambda n: (
            isinstance(n, ast.If)
            and n in closure.body
            and any(callee(c) == "host_to_device_state" for c in ast.walk(n))
        ),
    )
    first = min(wait.lineno, slots.lineno)
    assert first == wait.lineno, "the load closure no longer waits before its state path"
    old = "".join(src.text.splitlines(True)[wait.lineno - 1 : slots.end_lineno])
    moved = src.lines(slots)
    src.replace(old, moved + old.replace(moved, ""))


def state_store_not_recorded_for_loads(root):
    # the ledger's one store path (pages and state slots) records nothing for the loads
    src = Source(root, LEDGER)
    fn = src.func("store")
    record = src.only(fn, "record_store(...)", calling("record_store"))
    src.delete(src.statement(fn, record), within=fn)


def ledger_records_no_store(root):
    src = Source(root, "kv/copy_ledger.py")
    fn = src.func("record_store")
    loop = src.only(fn, "loop recording the store", lambda n: isinstance(n, ast.For))
    src.delete(loop, within=fn)


def ledger_finds_no_store(root):
    src = Source(root, "kv/copy_ledger.py")
    fn = src.func("stores_of")
    ret = src.only(fn, "return", lambda n: isinstance(n, ast.Return))
    src.replace_in(fn, src.segment(ret), "return set()")


def store_recorded_under_its_device_pages(root):
    src = Source(root, LEDGER)
    fn = src.func("store")
    record = src.only(fn, "record_store(...)", calling("record_store"))
    src.replace_in(fn, src.segment(record), src.segment(record).replace("host_", "dev_"))


# --- 1c, 2a: submit records the producer, the worker waits on it ------------------------


def producer_recorded_on_a_side_stream(root):
    src = Source(root, "kv/copy_engine.py")
    current = src.only(src.func("submit"), "current_stream()", calling("current_stream"))
    src.replace(src.segment(current), "self.streams[0]")


def producer_skipped_on_the_default_stream(root):
    src = Source(root, "kv/copy_engine.py")
    submit = src.func("submit")
    record = src.only(submit, "record()", calling("record"))
    stmt = next(s for s in ast.walk(submit) if isinstance(s, ast.Expr) and s.value is record)
    old = src.lines(stmt)
    pad = old[: len(old) - len(old.lstrip())]
    guard = f"{pad}if torch.cuda.current_stream(self.device).cuda_stream != 0:\n"
    src.replace(old, guard + "    " + old)


def task_queued_before_the_producer_is_recorded(root):
    src = Source(root, "kv/copy_engine.py")
    submit = src.func("submit")
    record = src.only(submit, "record()", calling("record"))
    queue = src.only(submit, "q.put(...)", calling("put"))
    first, last = src.statement(submit, record), src.statement(submit, queue)
    old = "".join(src.text.splitlines(True)[first.lineno - 1 : last.end_lineno])
    moved = src.lines(last)  # same body, same indentation
    src.replace(old, moved + old.replace(moved, ""))


def worker_waits_on_another_event(root):
    src = Source(root, "kv/copy_engine.py")
    run = src.func("_issue")
    wait = src.only(run, "wait_event()", calling("wait_event"))
    src.replace(src.segment(wait), f"{src.segment(wait.func)}(handle.start_event)")


def worker_copies_before_its_stream_waits(root):
    src = Source(root, "kv/copy_engine.py")
    run = src.func("_issue")
    block = src.only(
        run,
        "copy stream block",
        lambda n: (
            isinstance(n, ast.With) and any(callee(i.context_expr) == "stream" for i in n.items)
        ),
    )
    task = [s for s in block.body if any(callee(n) == "copy" for n in ast.walk(s))]
    assert len(task) == 1, f"expected the copy stream block to run the task once: {task}"
    cuda = next(s for s in ast.walk(run) if isinstance(s, ast.If) and block in s.body)
    old, moved = src.lines(cuda), src.lines(task[0])
    assert old.count(moved) == 1
    pad = old[: len(old) - len(old.lstrip())]
    src.replace(old, pad + moved.lstrip() + old.replace(moved, ""))


# --- 3b: compute waits for the step's copies --------------------------------------------


def _replay_branch(src, fn) -> ast.If:
    """`if graph:` in ModelRunner._forward: the replay and the waits before it."""
    return src.only(
        fn, "if graph:", lambda n: isinstance(n, ast.If) and src.segment(n.test) == "graph"
    )


def replay_wait_deleted(root):
    src = Source(root, "runner/model_runner.py")
    fn = src.func("_forward")
    wait = src.only(fn, "wait_gates()", calling("wait_gates"))
    src.delete(src.statement(_replay_branch(src, fn), wait))


def replay_before_its_wait(root):
    src = Source(root, "runner/model_runner.py")
    fn = src.func("_forward")
    branch = _replay_branch(src, fn)
    wait, replay = branch.body[0], branch.body[-1]
    assert isinstance(wait, ast.For) and src.segment(replay).count("_replay") == 1
    old = "".join(src.text.splitlines(True)[wait.lineno - 1 : replay.end_lineno])
    pad = old[: len(old) - len(old.lstrip())]
    call = src.only(replay, "_replay()", calling("_replay"))
    src.replace(old, f"{pad}out = {src.segment(call)}\n{src.lines(wait)}{pad}return out\n")


def eager_forward_without_layer_waits(root):
    src = Source(root, "runner/model_runner.py")
    fn = src.func("_forward")
    ctx = src.only(fn, "ForwardContext(...)", calling("ForwardContext"))
    src.replace(src.segment(ctx.args[4]), "None")


def eager_hook_that_waits_on_nothing(root):
    src = Source(root, "runner/model_runner.py")
    wait = src.only(src.func("_forward"), "wait_layer()", calling("wait_layer"))
    src.replace(src.segment(wait), f"{src.segment(wait.func.value)}.is_done()")


def layer_reads_kv_before_its_hook(root):
    src = Source(root, "layers/attention.py")
    fn = src.func("forward")
    hook = src.only(fn, "before_layer()", calling("before_layer"))
    src.delete(src.statement(fn, hook), within=fn)


def fused_rope_store_before_its_hook(root):
    """forward_qkv: the Llama family's default path on Triton (rope and K/V store in one
    launch) without its wait."""
    src = Source(root, "layers/attention.py")
    fn = src.func("forward_qkv")
    hook = src.only(fn, "before_layer()", calling("before_layer"))
    src.delete(src.statement(fn, hook), within=fn)


# --- 6a: no copy overlaps a graph capture -----------------------------------------------


def capture_guard_removed(root):
    src = Source(root, "runner/cuda_graphs.py")
    fn = src.func("capture")
    guard = src.only(fn, "with the guard", lambda n: isinstance(n, ast.With))
    old = src.lines(guard)
    src.replace(old, src.lines(guard.body[0]).replace("    ", "", 1))


def engine_passes_no_capture_guard(root):
    src = Source(root, "engine/decode_graphs.py")
    graphs = src.only(src.tree, "DecodeGraphs(...)", calling("DecodeGraphs"))
    guard = next(k for k in graphs.keywords if k.arg == "capture_guard")
    src.replace(src.segment(guard), "capture_guard=None")


def engine_passes_a_guard_that_pauses_nothing(root):
    src = Source(root, "engine/decode_graphs.py")
    graphs = src.only(src.tree, "DecodeGraphs(...)", calling("DecodeGraphs"))
    guard = next(k for k in graphs.keywords if k.arg == "capture_guard")
    src.replace(src.segment(guard), "capture_guard=contextlib.nullcontext")


def _graphs_built_without_copies(root, rel: str) -> None:
    src = Source(root, rel)
    build = src.only(src.tree, "build_decode_graphs(...)", calling("build_decode_graphs"))
    copies = next(k for k in build.keywords if k.arg == "copies")
    src.replace(src.segment(copies), "copies=None")


def engine_builds_graphs_without_the_tiers_copies(root):
    _graphs_built_without_copies(root, "engine/builder.py")


def tp_worker_builds_graphs_without_its_mirrors_copies(root):
    # the worker's graphs come from builder.build_runner, as rank 0's: drop its copies there
    src = Source(root, "engine/tp_worker.py")
    build = src.only(src.tree, "build_runner(...)", calling("build_runner"))
    copies = next(k for k in build.keywords if k.arg == "copies")
    src.replace(src.segment(copies), "copies=None")


def capture_guard_not_taken_from_the_constructor(root):
    src = Source(root, "runner/cuda_graphs.py")
    init = src.func("__init__", src.cls("DecodeGraphs"))
    stmt = src.only(
        init,
        "self.capture_guard = ...",
        lambda n: isinstance(n, ast.Assign) and src.segment(n.targets[0]) == "self.capture_guard",
    )
    src.replace(src.segment(stmt), "self.capture_guard = nullcontext")


def worker_ignores_the_pause(root):
    src = Source(root, "kv/copy_engine.py")
    run = src.func("_issue")
    loop = src.only(
        run,
        "while self._paused",
        lambda n: isinstance(n, ast.While) and src.segment(n.test) == "self._paused",
    )
    src.delete(loop)


def new_capture_outside_the_guard(root):
    src = Source(root, "runner/cuda_graphs.py")
    graphs = src.cls("DecodeGraphs")
    last = graphs.body[-1]
    src.insert_after(
        last,
        """\

        def recapture(self, bs: int) -> None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._forward(bs)
            self.graphs[bs] = graph
        """,
    )


# --- the tensor-parallel worker's mirror (kv/tier_mirror.py) -----------------------------


def mirror_load_skips_its_store_wait(root):
    # the worker's mirror issuing a load itself, bypassing its ledger's store wait
    src = Source(root, "kv/tier_mirror.py")
    fn = src.func("_load")
    ledger = src.only(fn, "ledger.load(...)", calling("load"))
    src.replace_in(
        fn,
        src.segment(ledger),
        """self.copies.submit(
            "load",
            0,
            lambda h: host_to_device_pages(
                self.host_pool.kv, self.device_pool.kv, c.host_pages, c.dev_pages, h.mark
            ),
            num_gates=self.device_pool.kv.shape[0],
        )""",
    )
    src.insert_at_top(fn, "from batchgen.kv.page_copies import host_to_device_pages\n")


def mirror_store_not_recorded_for_loads(root):
    # the worker's mirror issuing a store itself: its ledger's writing map never sees it
    src = Source(root, "kv/tier_mirror.py")
    fn = src.func("_store")
    ledger = src.only(fn, "ledger.store(...)", calling("store"))
    src.replace_in(
        fn,
        src.segment(ledger),
        """self.copies.submit(
            "store",
            0,
            lambda h: device_to_host_pages(
                self.device_pool.kv, self.host_pool.kv, c.dev_pages, c.host_pages
            ),
        )""",
    )
    src.insert_at_top(fn, "from batchgen.kv.page_copies import device_to_host_pages\n")


def worker_forward_ignores_its_copies(root):
    Source(root, "engine/tensor_parallel.py").replace("wait_for=waits,", "wait_for=[],")


def worker_replays_no_copies(root):
    src = Source(root, "engine/tensor_parallel.py")
    src.replace("mirror.issue(message.copies, forward) if mirror is not None else []", "[]")


MUTATIONS = [
    (sync_store_with_noop_closure, "1a"),
    (sync_staged_store_with_noop_closure, "1a"),
    (sync_load_with_noop_closure, "1a"),
    (sync_layer_store_with_noop_closure, "1a"),
    (closure_reference_instead_of_call, "1a"),
    (submitted_closure_also_called, "1a"),
    (closure_handed_to_another_executor, "1a"),
    (submit_runs_the_copy_it_is_given, "1a"),
    (copy_body_through_its_module, "1a"),
    (copy_body_through_a_module_alias, "1a"),
    (copy_body_through_a_relative_name_alias, "1a"),
    (copy_body_by_dotted_path_outside_kv, "1a"),
    (copy_body_without_a_direction, "1a"),
    (gather_that_copies_to_the_host, "1a"),
    (gather_that_moves_its_pages_to_the_host, "1a"),
    (gather_with_a_pageable_index, "1a"),
    (gather_through_a_copy_body, "1a"),
    (slice_assignment_between_pools, "1b"),
    (slice_assignment_through_a_local, "1b"),
    (slice_assignment_into_a_host_page_view, "1b"),
    (blocking_to_cpu, "1b"),
    (blocking_copy_between_pools, "1b"),
    (copy_into_host_pool_from_the_engine, "1b"),
    (write_into_device_pool_from_another_kv_module, "1b"),
    (readback_before_the_store_completes, "1b"),
    (state_readback_before_its_store_completes, "1b"),
    (engine_subclass_that_skips_the_wait, "2a"),
    (engine_subclass_under_another_name, "2a"),
    (engine_method_replaced_on_an_instance, "2a"),
    (engine_method_replaced_through_setattr, "2a"),
    (worker_wait_made_conditional, "2a"),
    (worker_wait_made_conditional, "2b"),
    (side_stream_copy_without_wait, "2b"),
    (worker_wait_deleted, "2b"),
    (graph_capture_wait_deleted, "2b"),
    (store_before_load_wait_deleted, "3a"),
    (store_before_load_waits_only_for_a_gate, "3a"),
    (load_waits_for_the_stores_of_other_pages, "3a"),
    (layer_store_not_recorded_for_loads, "3a"),
    (state_load_without_store_wait, "3a"),
    (state_store_not_recorded_for_loads, "3a"),
    (ledger_records_no_store, "3a"),
    (ledger_finds_no_store, "3a"),
    (store_recorded_under_its_device_pages, "3a"),
    (worker_wait_deleted, "2a"),
    (producer_recorded_on_a_side_stream, "1c"),
    (producer_skipped_on_the_default_stream, "1c"),
    (task_queued_before_the_producer_is_recorded, "1c"),
    (worker_waits_on_another_event, "2a"),
    (worker_copies_before_its_stream_waits, "2a"),
    (replay_wait_deleted, "3b"),
    (replay_before_its_wait, "3b"),
    (eager_forward_without_layer_waits, "3b"),
    (eager_hook_that_waits_on_nothing, "3b"),
    (layer_reads_kv_before_its_hook, "3b"),
    (fused_rope_store_before_its_hook, "3b"),
    (capture_guard_removed, "6a"),
    (engine_passes_no_capture_guard, "6a"),
    (engine_passes_a_guard_that_pauses_nothing, "6a"),
    (engine_builds_graphs_without_the_tiers_copies, "6a"),
    (tp_worker_builds_graphs_without_its_mirrors_copies, "6a"),
    (capture_guard_not_taken_from_the_constructor, "6a"),
    (worker_ignores_the_pause, "6a"),
    (new_capture_outside_the_guard, "6a"),
    (mirror_load_skips_its_store_wait, "3a"),
    (mirror_store_not_recorded_for_loads, "3a"),
    (worker_forward_ignores_its_copies, "3c"),
    (worker_replays_no_copies, "3c"),
]


@pytest.fixture
def package(tmp_path) -> Path:
    root = tmp_path / "src" / "batchgen"
    shutil.copytree(REPO / "src" / "batchgen", root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_check_and_its_mutations_cite_the_one_rule_table():
    """The rules are numbered once, in kv/copy_rules.py: every finding the check can name
    and every rule a mutation here breaks is a line of that table, the check says how it
    checks each, and every line not kept by tests alone is checked and broken here."""
    table = (REPO / "src" / "batchgen" / "kv" / "copy_rules.py").read_text()
    lines = dict(re.findall(r"^   (\d[a-z]) (.*)$", table, re.M))
    by_tests = {line for line, text in lines.items() if text.startswith("(tests)")}
    check = (REPO / "scripts" / "hygiene" / "copy_contract.py").read_text()
    named = set(re.findall(r'"(\d[a-z])"', check))
    described = set(re.findall(r"^(\d[a-z])  ", check, re.M))
    broken = {rule for _, rule in MUTATIONS}
    assert named <= set(lines), named - set(lines)
    assert named == described == broken == set(lines) - by_tests


def test_the_real_tree_keeps_the_contract(package):
    assert [str(f) for f in check_copy_contract(REPO / "src" / "batchgen")] == []
    assert [str(f) for f in check_copy_contract(package)] == []  # the copy mutations start from


@pytest.mark.slow  # ~40 mutations, each a copy of the package checked anew
@pytest.mark.parametrize(
    ("mutate", "rule"), MUTATIONS, ids=[f"{r}-{m.__name__}" for m, r in MUTATIONS]
)
def test_a_mutation_that_breaks_the_contract_is_reported(package, mutate, rule):
    before = {p.relative_to(package): p.read_text() for p in package.rglob("*.py")}
    mutate(package)
    after = {p.relative_to(package): p.read_text() for p in package.rglob("*.py")}
    assert after != before, "the mutation changed nothing"
    findings = check_copy_contract(package)
    assert f"copy-{rule}" in {f.rule for f in findings}, [str(f) for f in findings]
    assert all(f.where.startswith("src/batchgen/") and f.line > 0 for f in findings)
