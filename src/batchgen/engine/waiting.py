"""The waiting requests: who schedule() tries to admit, in order. `ArrivalWaiting` under
admission="arrival" (arrival order, preempted requests first); `PrefixWaiting` under
admission="prefix", below.

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
groups with a cached or claimed first page and the requests admitted, not to the waiting
pages nor to the waiting requests.

Cold groups: a child of the root whose first page is neither cached nor claimed (every
request of a workload with nothing shared is one) scores 0, so among them only arrival
order counts; they wait in a heap by their earliest request and are not looked up each
step. A first page becomes cached only when a request computes it, and an admitted
request claims its pages first (`claim` marks such a child for a look), or when a new
request joins the child (`WaitingTree.take_touched`). Anything else (a page-0 completed
by generated tokens, say) is caught by looking again at `RECHECK` cold groups per step,
round robin: a late look orders a request later than it might have been, never wrongly.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.waiting_tree import Node, WaitingTree
from batchgen.kv.kv_manager import KVCacheManager

RECHECK = 16  # cold groups looked at again per step, round robin


class ArrivalWaiting(deque):
    """A deque in admission order (a preempted request is put back at its front) with
    PrefixWaiting's calls; claims are not kept."""

    def add(self, req: Request, hashes: list[bytes]) -> None:
        self.append(req)

    def take(self, req: Request) -> None:
        """`req` (the first, a candidate) was admitted."""
        self.popleft()

    def claim(self, request_id: str, hashes: list[bytes]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def candidates(self, kv: KVCacheManager) -> Iterator[Request]:
        """The first request while it waits (the caller admits it, `take`, or stops)."""
        while self:
            yield self[0]

    def pages_to_admit(self, req: Request, kv: KVCacheManager) -> int:
        """Free device pages the request's whole prompt would take."""
        return kv.pages_needed(len(req.token_ids))


class PrefixWaiting:
    """Deque-like for callers: len, bool, `in`, `remove`, `appendleft` (a preempted
    request) and iteration (preempted first, then by arrival: not the admission order)."""

    def __init__(self) -> None:
        self.resumed: deque[Request] = deque()
        self.tree = WaitingTree()
        self._seq = itertools.count()
        self._claims: dict[bytes, int] = {}  # page hash -> running requests computing it
        self._claimed: dict[str, list[bytes]] = {}  # request id -> the hashes it claims
        self._warm: set[Node] = set()  # root children looked up each step
        self._cold: set[Node] = set()  # root children neither cached nor claimed
        self._cold_heap: list[tuple[tuple[int, int], int, Node]] = []  # by earliest request
        self._cold_ring: deque[Node] = deque()  # the round-robin second look
        self._order = itertools.count()

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
        if hashes:  # a claimed page 0 may be a root child's first page: look at it
            child = self.tree.root.children.get(hashes[0])
            if child is not None:
                self._warm.add(child)
                self._cold.discard(child)

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
        if not kv.num_free_pages:
            return  # an admission takes at least one page
        while self.resumed:
            head = self.resumed[0]
            yield head
            if self.resumed and self.resumed[0] is head:
                return
        if not self.tree:
            return
        heap = []
        order = itertools.count()
        for score, node, miss in self._groups(kv):
            lead = _leader(node, miss)
            heap.append((-score, lead[0], next(order), node, miss))
        heapq.heapify(heap)
        while True:
            cold = self._cold_top()
            if heap and (cold is None or (heap[0][0], heap[0][1]) < (0, cold.first[0])):
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
            elif cold is not None:
                if cold.edge[0] in self._claims:  # claimed this step: deferred from now on
                    self._cold.discard(cold)
                    self._warm.add(cold)
                    continue
                req = cold.first[1]
                yield req
                if req in self.tree:
                    return
            else:
                return

    def pages_to_admit(self, req: Request, kv: KVCacheManager) -> int:
        """Free device pages the request's whole prompt would take, counting the cached
        pages running requests hold as free (a swapped request's all)."""
        if req.status == RequestStatus.SWAPPED:
            return kv.pages_needed(len(req.token_ids))
        return kv.free_pages_to_admit(req.request_id, req.token_ids)

    def _groups(self, kv: KVCacheManager) -> list[tuple[int, Node, bytes]]:
        """`WaitingTree.frontier` without the cold root children (see the module doc):
        the warm ones, those new or joined since the last step and RECHECK cold ones are
        looked up; the uncached and unclaimed among them turn cold."""
        tree, root = self.tree, self.tree.root
        look = self._warm
        look.update(tree.take_touched())
        for _ in range(min(RECHECK, len(self._cold_ring))):
            node = self._cold_ring.popleft()
            if node in self._cold:
                self._cold.discard(node)
                look.add(node)
        self._warm = set()
        groups = [(0, root, b"")] if root.members else []
        below = []
        # Arrival order, so the cold ring (and so which request a second look finds
        # first) does not depend on where the nodes happen to sit in memory.
        for child in sorted(look, key=_arrival):
            if not tree.is_root_child(child):
                continue
            k = _cached_run(kv, child.edge)
            if k == 0 and child.edge[0] not in self._claims:
                self._make_cold(child)
                continue
            self._warm.add(child)
            if k == len(child.edge):
                below.append(child)
            else:
                groups.append((k, child, child.edge[k]))
        groups += tree.frontier_below(below, lambda edge: _cached_run(kv, edge))
        return groups

    def _make_cold(self, node: Node) -> None:
        self._cold.add(node)
        heapq.heappush(self._cold_heap, (node.first[0], next(self._order), node))
        self._cold_ring.append(node)
        limit = 2 * len(self._cold) + 64
        if len(self._cold_heap) > limit or len(self._cold_ring) > limit:
            self._compact()

    def _compact(self) -> None:
        """Drop stale entries: cold nodes detached since, duplicates."""
        tree = self.tree
        self._cold = {n for n in self._cold if tree.is_root_child(n) and n.size}
        self._cold_heap = [(n.first[0], next(self._order), n) for n in self._cold]
        heapq.heapify(self._cold_heap)
        self._cold_ring = deque(self._cold)

    def _cold_top(self) -> Node | None:
        """The cold root child with the earliest request (entries checked lazily)."""
        heap, tree = self._cold_heap, self.tree
        while heap:
            key, _, node = heap[0]
            if node not in self._cold or not tree.is_root_child(node) or not node.size:
                heapq.heappop(heap)
                continue
            if node.first[0] != key:  # its earliest request was admitted or replaced
                heapq.heapreplace(heap, (node.first[0], next(self._order), node))
                continue
            return node
        return None


def _arrival(node: Node):
    return node.first[0] if node.first is not None else (float("inf"), 0)


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
