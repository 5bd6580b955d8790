"""Per-request page tables over the page allocator, with prefix-cache lookups."""

from __future__ import annotations

from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.prefix_hash import hash_full_pages


class KVCacheManager:
    """Maps request ids to the pages holding their KV.

    A request's page list covers tokens [0, num_computed + num_new): page i holds
    tokens [i*page_size, (i+1)*page_size). Full pages are registered in the prefix
    cache once their tokens are computed.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, enable_prefix_caching)
        self.pages: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def lookup_prefix(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Cached pages for the request's longest hit; at least one token stays to compute."""
        hashes = hash_full_pages(token_ids, self.page_size, self._hashes.get(request_id))
        self._hashes[request_id] = hashes
        max_pages = (len(token_ids) - 1) // self.page_size
        return self.allocator.lookup(hashes[:max_pages])

    def allocate(self, request_id: str, num_tokens: int, hit_pages: list[int] = ()) -> bool:
        """Make the request's pages cover num_tokens tokens; False (nothing changed) if short."""
        held = self.pages.get(request_id, [])
        need = self.pages_needed(num_tokens) - len(held) - len(hit_pages)
        if need > self.allocator.num_free_after_touch(list(hit_pages)):
            return False
        if hit_pages:
            self.allocator.touch(list(hit_pages))
            self.prefix_hit_tokens += len(hit_pages) * self.page_size
        new = self.allocator.allocate(max(need, 0))
        self.pages[request_id] = held + list(hit_pages) + new
        if hit_pages:
            self._num_registered[request_id] = len(hit_pages)
        return True

    def note_admission(self, num_tokens: int) -> None:
        """Count an admitted request's tokens toward the prefix-cache query total."""
        self.prefix_query_tokens += num_tokens

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register every full page whose tokens are all computed."""
        if not self.allocator.enable_caching:
            return
        full = num_computed // self.page_size
        done = self._num_registered.get(request_id, 0)
        if full <= done:
            return
        hashes = hash_full_pages(
            token_ids[: full * self.page_size],
            self.page_size,
            self._hashes.get(request_id, [])[:full],
        )
        self._hashes[request_id] = hashes
        pages = self.pages[request_id]
        for i in range(done, full):
            self.allocator.register(pages[i], hashes[i])
        self._num_registered[request_id] = full

    def free(self, request_id: str) -> None:
        """Release the request's pages (they stay findable by hash until evicted)."""
        self.allocator.free(self.pages.pop(request_id, []))
        self._num_registered.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Drop everything kept for a finished request."""
        self.free(request_id)
        self._hashes.pop(request_id, None)

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free
