"""The waiting requests under admission="prefix": who schedule() tries to admit, in order.

Order:
1. Preempted requests (swapped, or put back for recompute) first, in their order, the
   first one blocking the rest exactly as in arrival order.
2. The others by cached prefix length (device or host pages; longest first), ties by
   arrival (`Request.arrival`, then the order of `add`).
3. A request whose first uncached page is claimed (a running request, or one admitted
   earlier in the same schedule() call, will compute it) is deferred: skipped this step
   without blocking the others, so that it hits that page once computed. Requests sharing
   only a head of pages are deferred only until the head is computed.

Invariants:
- Claims are held by running requests only: `claim` at admission, `release` when the
  request leaves the running set (finish, preemption, abort), so a deferral always waits
  on a request that makes progress, and nothing waits with an empty running set.
- A claimed page that is computed is registered in the prefix cache, so it is a hit, not
  a first uncached page: stale claims (until release) defer nobody.

Cost of a step: the waiting requests sit in a `WaitingTree` built from hashes computed
once per request at `add`; `candidates` walks the nodes of cached prefixes and their
children (a few lookups per edge), then pops groups from a heap: proportional to the
groups and the requests admitted, not to the waiting pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from batchgen.engine.request import Request
from batchgen.engine.waiting_tree import Node, WaitingTree
from batchgen.kv.kv_manager import KVCacheManager


class PrefixWaiting:
    """Deque-like for callers: len, bool, `in`, `remove`, `appendleft` (a preempted
    request) and iteration (preempted first, then by arrival: not the admission order)."""

    def __init__(self) -> None:
        self.resumed: deque[Request] = deque()
        self.tree = WaitingTree()
        self._seq = itertools.count()
        self._claims: dict[bytes, int] = {}  # page hash -> running requests computing it
        self._claimed: dict[str, list[bytes]] = {}  # request id -> the hashes it claims

    def __len__(self) -> int:
        return len(self.resumed) + len(self.tree)

    def __iter__(self) -> Iterator[Request]:
        yield from self.resumed
        yield from self.tree

    def __getitem__(self, i: int) -> Request:
        return list(self)[i]

    def __contains__(self, req: Request) -> bool:
        return req in self.tree or req in self.resumed

    def add(self, req: Request, hashes: list[bytes]) -> None:
        """A new request, filed under its lookup-able page hashes (computed once)."""
        self.tree.insert(req, (req.arrival, next(self._seq)), hashes)

    def appendleft(self, req: Request) -> None:
        """A preempted request: resumed before everything else."""
        self.resumed.appendleft(req)

    def remove(self, req: Request) -> None:
        if req in self.tree:
            self.tree.remove(req)
        else:
            self.resumed.remove(req)

    def take(self, req: Request) -> None:
        """`req` (a candidate) was admitted."""
        if self.resumed and self.resumed[0] is req:
            self.resumed.popleft()
        else:
            self.tree.remove(req)

    # ---- claims --------------------------------------------------------------------
    def claim(self, request_id: str, hashes: list[bytes]) -> None:
        """An admitted request will compute the pages `hashes` name."""
        self._claimed[request_id] = hashes
        for h in hashes:
            self._claims[h] = self._claims.get(h, 0) + 1

    def release(self, request_id: str) -> None:
        """The request left the running set: its claims go."""
        for h in self._claimed.pop(request_id, ()):
            n = self._claims[h] - 1
            if n:
                self._claims[h] = n
            else:
                del self._claims[h]

    # ---- order ---------------------------------------------------------------------
    def candidates(self, kv: KVCacheManager) -> Iterator[Request]:
        """The requests to try, best first. The caller admits each (`take`, then
        `claim`) before asking for the next, or stops: a candidate still waiting when
        the next is asked for ends the iteration."""
        while self.resumed:
            head = self.resumed[0]
            yield head
            if self.resumed and self.resumed[0] is head:
                return
        if not self.tree:
            return
        heap = []
        order = itertools.count()
        for score, node, miss in self.tree.frontier(lambda edge: _cached_run(kv, edge)):
            lead = _leader(node, miss)
            heap.append((-score, lead[0], next(order), node, miss))
        heapq.heapify(heap)
        while heap:
            neg, _, _, node, miss = heapq.heappop(heap)
            if miss and miss in self._claims:
                continue  # deferred: a running request is computing its next page
            req = _leader(node, miss)[1]  # groups are disjoint: only `take` changes it
            yield req
            if req in self.tree:
                return
            lead = _leader(node, miss)
            if lead is not None:
                heapq.heappush(heap, (neg, lead[0], next(order), node, miss))


def _leader(node: Node, miss: bytes):
    """The group's earliest request: the node's own members when cached all the way
    (miss is empty), else its whole subtree's."""
    if not miss:
        return node.members[0] if node.members else None
    return node.first if node.size else None


def _cached_run(kv: KVCacheManager, edge: list[bytes]) -> int:
    """Leading pages of `edge` in the cache, found by bisection (a cached prefix is
    assumed to be whole: an estimate when a middle page was evicted alone)."""
    cached = kv.is_cached
    if not cached(edge[0]):
        return 0
    if cached(edge[-1]):
        return len(edge)
    lo, hi = 1, len(edge) - 1  # edge[lo - 1] is cached, edge[hi] is not
    while lo < hi:
        mid = (lo + hi) // 2
        if cached(edge[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo
