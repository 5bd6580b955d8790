"""Page bookkeeping for the device pool: free queue, reference counts, prefix cache.

Invariants:
- A page is in exactly one of two states: held (ref_count > 0, not in the free
  queue) or free (ref_count == 0, in the free queue).
- A free page may still carry a hash: it is "free but cached" and can be revived by a
  prefix hit until allocation evicts it. The free queue is an LRU: allocation takes from
  the front; freed pages without a hash go to the front (worthless), freed cached pages
  to the back.
- Free cached pages that an unfinished request wants (the hashes named by `want` and
  not since by `unwant`) wait in a second LRU queue, taken only once the first is empty:
  a page nobody waits for is evicted before one a waiting or preempted request will hit.
- Only the allocator changes ref counts; only `allocate` evicts a cached hash (and tells
  its caller: `allocate(n, on_evict)`).

The allocator calls nothing it was built with, so that the KV manager and the host tier,
which both hold it, can each be handed it when they are built.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class PageAllocator:
    def __init__(self, num_pages: int, enable_caching: bool = True) -> None:
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self._wanted: set[bytes] = set()  # hashes an unfinished request will look up
        self.ref_count = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self._kept: OrderedDict[int, None] = OrderedDict()  # free, cached and wanted
        self._page_hash: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._kept)

    def num_free_after_touch(self, pages: list[int]) -> int:
        """Free pages left once `pages` (prefix hits) are taken out of the free queue."""
        return self.num_free - sum(1 for p in pages if self.ref_count[p] == 0)

    def allocate(self, n: int, on_evict: Callable[[int, bytes], None] | None = None) -> list[int]:
        """n free pages, each held once; `on_evict(page, hash)` for each cached page
        reused, as it is taken."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            page, _ = (self._free or self._kept).popitem(last=False)
            h = self._page_hash.pop(page, None)
            if h is not None:
                del self._cached[h]
                self.evictions += 1
                if on_evict is not None:
                    on_evict(page, h)
            self.ref_count[page] = 1
            pages.append(page)
        return pages

    def touch(self, pages: list[int]) -> None:
        """Take a reference on cached pages found by `lookup`."""
        for page in pages:
            if self.ref_count[page] == 0:
                del (self._free if page in self._free else self._kept)[page]
            self.ref_count[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page; the tail of a sequence is freed first. (A
        finished request frees every page it held in one call: the loop's names are
        bound once, as it runs for each page of each request.)"""
        ref_count, page_hash = self.ref_count, self._page_hash
        free, kept, wanted = self._free, self._kept, self._wanted
        for page in reversed(pages):
            left = ref_count[page] - 1
            assert left >= 0, f"page {page} freed twice"
            ref_count[page] = left
            if left:
                continue
            h = page_hash.get(page)
            if h is None:
                free[page] = None
                free.move_to_end(page, last=False)
            elif h in wanted:
                kept[page] = None
            else:
                free[page] = None

    def want(self, page_hash: bytes) -> None:
        """An unfinished request now wants `page_hash`: a free page holding it is kept."""
        self._wanted.add(page_hash)
        page = self._cached.get(page_hash)
        if page in self._free:
            del self._free[page]
            self._kept[page] = None

    def unwant(self, page_hash: bytes) -> None:
        """No unfinished request wants `page_hash` any more: back to the LRU queue."""
        self._wanted.discard(page_hash)
        page = self._cached.get(page_hash)
        if page in self._kept:
            del self._kept[page]
            self._free[page] = None

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `hashes` (no reference taken)."""
        pages = []
        if self.enable_caching:
            for h in hashes:
                page = self._cached.get(h)
                if page is None:
                    break
                pages.append(page)
        return pages

    def is_cached(self, page_hash: bytes) -> bool:
        """A page (held or free) holds `page_hash`: `lookup([page_hash])` without a list."""
        return self.enable_caching and page_hash in self._cached

    def register(self, page: int, page_hash: bytes) -> None:
        """Mark a held, full page as holding the tokens `page_hash` names."""
        if not self.enable_caching or page in self._page_hash or page_hash in self._cached:
            return
        self._page_hash[page] = page_hash
        self._cached[page_hash] = page

    def cached_pages(self) -> list[tuple[int, bytes]]:
        """(page, hash) of every page holding a cached prefix page, held or free."""
        return list(self._page_hash.items())

    def page_hash(self, page: int) -> bytes | None:
        return self._page_hash.get(page)

    def reset(self) -> None:
        """Forget every cached hash; only valid when no page is held."""
        assert all(r == 0 for r in self.ref_count), "reset with pages held"
        self._page_hash.clear()
        self._cached.clear()
        self._free = OrderedDict((p, None) for p in range(self.num_pages))
        self._kept.clear()

    def resize(self, num_pages: int) -> None:
        """Bookkeeping for a new, empty pool of num_pages (the engine's reconfigure): no
        page held or cached, no eviction counted; the wanted hashes carry over."""
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        self.evictions = 0
        self._kept.clear()
        self.reset()
