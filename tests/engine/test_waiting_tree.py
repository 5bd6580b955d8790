"""WaitingTree: requests filed by page hashes, grouped by shared cached prefix."""

from __future__ import annotations

import random

from batchgen.engine import waiting_tree
from batchgen.engine.request import Request
from batchgen.engine.waiting_tree import WaitingTree
from batchgen.sampling_params import SamplingParams


def req(rid: str, arrival: int = 0) -> Request:
    return Request(rid, [1], SamplingParams(), 1, arrival=arrival)


def h(*names) -> list[bytes]:
    """Page hashes as readable chained names: h("a", "b") -> [b"a", b"a/b"]."""
    out, path = [], ""
    for n in names:
        path = f"{path}/{n}" if path else n
        out.append(path.encode())
    return out


def cached_upto(cached: set[bytes]):
    def run(edge):
        k = 0
        while k < len(edge) and edge[k] in cached:
            k += 1
        return k

    return run


def check(tree: WaitingTree) -> None:
    """size and first agree with the members below every node; edges are non-empty and
    siblings differ from their first page; each node's heap files every child under its
    current first."""

    def walk(node, depth):
        assert node.depth == depth
        members = list(node.members)
        for first, child in node.children.items():
            assert child.parent is node and child.edge and child.edge[0] == first
            members += walk(child, depth + len(child.edge))
        assert node.size == len(members)
        if node.parent is not None:
            assert node.size > 0
        assert node.first == (min(members, key=lambda e: e[0]) if members else None)
        for child in node.children.values():
            assert any(c is child and key == child.first[0] for key, _, c in node.heap)
        return members

    walk(tree.root, 0)


def test_insert_splits_edges_where_prompts_diverge():
    t = WaitingTree()
    a, b, c, d = req("a"), req("b"), req("c"), req("d")
    t.insert(a, (0, 0), h("s", "x", "y"))
    t.insert(b, (0, 1), h("s", "x", "z"))
    t.insert(c, (0, 2), h("s"))  # ends inside the shared edge: a node of its own
    t.insert(d, (0, 3), [])  # no full page: at the root
    check(t)
    s = t.root.children[b"s"]
    assert s.edge == [b"s"] and [m[1] for m in s.members] == [c]
    x = s.children[b"s/x"]
    assert x.edge == [b"s/x"] and set(x.children) == {b"s/x/y", b"s/x/z"}
    assert [r.request_id for r in t] == ["a", "b", "c", "d"]
    assert len(t) == 4 and a in t


def test_remove_detaches_empty_subtrees_and_keeps_first():
    t = WaitingTree()
    rs = [req(f"r{i}", arrival=10 - i) for i in range(4)]
    t.insert(rs[0], (10, 0), h("p", "q"))
    t.insert(rs[1], (9, 1), h("p", "r"))
    t.insert(rs[2], (8, 2), h("p", "r", "s"))
    t.insert(rs[3], (7, 3), h("o"))
    check(t)
    assert t.root.first[1] is rs[3]
    t.remove(rs[3])
    assert b"o" not in t.root.children
    check(t)
    assert t.root.first[1] is rs[2]
    t.remove(rs[2])
    t.remove(rs[1])
    check(t)
    assert list(t) == [rs[0]] and rs[1] not in t
    t.remove(rs[0])
    check(t)
    assert len(t) == 0 and not t.root.children and t.root.first is None


def test_frontier_groups_share_cached_prefix_and_first_uncached_page():
    t = WaitingTree()
    for i, q in enumerate(["q0", "q1", "q2"]):
        t.insert(req(f"a{i}"), (i, i), h("A1", "A2", "A3", q))
    t.insert(req("b0"), (3, 3), h("B1", "B2"))
    t.insert(req("e"), (4, 4), h("A1", "A2", "A3"))  # all its pages cached
    groups = t.frontier(cached_upto(set(h("A1", "A2", "A3")) | {b"B1"}))
    got = sorted((score, miss, node.size) for score, node, miss in groups)
    # A's prefix is cached: each question is its own group of 3 cached pages; e's pages
    # are all cached (an empty miss); B is cached one page deep.
    assert got == [
        (1, b"B1/B2", 1),
        (3, b"", 4),
        (3, b"A1/A2/A3/q0", 1),
        (3, b"A1/A2/A3/q1", 1),
        (3, b"A1/A2/A3/q2", 1),
    ]
    # Nothing cached: one group per first page, the whole subtree behind it.
    groups = t.frontier(cached_upto(set()))
    assert sorted((s, m, n.size) for s, n, m in groups) == [(0, b"A1", 4), (0, b"B1", 1)]


def test_random_inserts_and_removes_keep_the_invariants():
    rng = random.Random(0)
    t = WaitingTree()
    live = []
    for i in range(300):
        if live and rng.random() < 0.4:
            t.remove(live.pop(rng.randrange(len(live))))
        else:
            r = req(f"r{i}", arrival=rng.randrange(50))
            t.insert(r, (r.arrival, i), h(*[rng.choice("ab") for _ in range(rng.randrange(6))]))
            live.append(r)
        check(t)
    assert sorted(live, key=lambda r: (r.arrival, int(r.request_id[1:]))) == list(t)


def test_taking_the_earliest_of_many_distinct_prompts_looks_at_few_entries(monkeypatch):
    """A batch of n prompts sharing no page is n children of the root; admitting them in
    arrival order recomputes the root's first n times. Each looks at the heap's top
    entries only (a scan of the children made 16,384 requests' removals quadratic)."""
    n = 2048
    t = WaitingTree()
    rs = [req(f"r{i}", arrival=i) for i in range(n)]
    for i, r in enumerate(rs):
        t.insert(r, (i, 0), h(f"p{i}", "q"))
    looks = 0
    current = waiting_tree.Node._current

    def counted(self, entry):
        nonlocal looks
        looks += 1
        return current(self, entry)

    monkeypatch.setattr(waiting_tree.Node, "_current", counted)
    for r in rs:
        assert t.root.first[1] is r
        t.remove(r)
    assert t.root.first is None and not t.root.children
    assert looks <= 4 * n  # a scan of the children would be n * (n + 1) / 2
