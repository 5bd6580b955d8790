"""Per-request page tables over the page allocator, with prefix-cache lookups and, when
a host tier is attached, host mirrors (swap, host prefix hits, write-through)."""

from __future__ import annotations

from batchgen.kv.host_mirror import HostMirror
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.prefix_hash import hash_full_pages


class PrefixHit(list):
    """Device pages of a request's cached prefix; `host_pages` continue it from the host
    tier (loaded into new device pages at allocation)."""

    def __init__(self, device_pages=(), host_pages=(), host_mirror=()) -> None:
        super().__init__(device_pages)
        self.host_pages = list(host_pages)
        self.host_mirror = list(host_mirror)  # host copies of every hit page, from page 0


class KVCacheManager:
    """Maps request ids to the pages holding their KV.

    A request's page list covers tokens [0, num_computed + num_new): page i holds
    tokens [i*page_size, (i+1)*page_size). Full pages are registered in the prefix
    cache once their tokens are computed.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool,
        mirror: HostMirror | None = None,
    ) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, enable_prefix_caching)
        self.mirror = mirror
        self.pages: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.host_hit_tokens = 0

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_hashes(self, request_id: str, token_ids: list[int]) -> list[bytes]:
        """Chained hashes of the request's full pages (kept, extended as tokens grow)."""
        hashes = self._hashes.get(request_id)
        if hashes is None or len(hashes) < len(token_ids) // self.page_size:
            hashes = hash_full_pages(token_ids, self.page_size, hashes)
            self._hashes[request_id] = hashes
        return hashes

    def lookup_prefix(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """Cached pages for the request's longest hit; at least one token stays to compute."""
        hashes = self.page_hashes(request_id, token_ids)
        max_pages = (len(token_ids) - 1) // self.page_size
        device = self.allocator.lookup(hashes[:max_pages])
        if self.mirror is None or not self.allocator.enable_caching:
            return PrefixHit(device)
        host = self.mirror.tier.lookup(hashes[:max_pages])
        return PrefixHit(device, host[len(device) :], host)

    def cached_prefix_pages(self, request_id: str, token_ids: list[int]) -> int:
        """Pages of the request's longest cached prefix (device, then host), as
        lookup_prefix would find it, without counting a query: for admission order."""
        hashes = self.page_hashes(request_id, token_ids)[: (len(token_ids) - 1) // self.page_size]
        device = len(self.allocator.lookup(hashes))
        if self.mirror is None or not self.allocator.enable_caching or device == len(hashes):
            return device
        return max(device, len(self.mirror.tier.host_alloc.lookup(hashes)))

    def is_cached(self, page_hash: bytes) -> bool:
        """The page is in the device prefix cache or in the host tier's (no reference
        taken, no counter touched): for admission order."""
        if not self.allocator.enable_caching:
            return False
        if self.allocator.lookup([page_hash]):
            return True
        return self.mirror is not None and bool(self.mirror.tier.host_alloc.lookup([page_hash]))

    def free_pages_to_admit(self, request_id: str, token_ids: list[int]) -> int:
        """Free device pages admitting the whole request would take: the pages of its
        cached prefix that running requests hold cost none (no counter touched)."""
        hashes = self.page_hashes(request_id, token_ids)[: (len(token_ids) - 1) // self.page_size]
        ref = self.allocator.ref_count
        held = sum(1 for page in self.allocator.lookup(hashes) if ref[page] > 0)
        return self.pages_needed(len(token_ids)) - held

    def hit_tokens(self, hit: list[int]) -> int:
        return (len(hit) + len(getattr(hit, "host_pages", ()))) * self.page_size

    def allocate(self, request_id: str, num_tokens: int, hit_pages: list[int] = ()) -> bool:
        """Make the request's pages cover num_tokens tokens; False (nothing changed) if short.
        Host hits get new device pages, filled by loads the next forward waits for."""
        held = self.pages.get(request_id, [])
        host = list(getattr(hit_pages, "host_pages", ()))
        need = self.pages_needed(num_tokens) - len(held) - len(hit_pages)
        if need <= 0 and not hit_pages and not host:
            return True  # already covered: most decode steps
        if need > self.allocator.num_free_after_touch(list(hit_pages)):
            return False
        if hit_pages:
            self.allocator.touch(list(hit_pages))
            self.prefix_hit_tokens += len(hit_pages) * self.page_size
        first = len(held) + len(hit_pages)
        # grown in place: the runner's page rows then write only the pages added
        held += list(hit_pages) + self.allocator.allocate(max(need, 0))
        self.pages[request_id] = held
        if host:
            loaded = held[first : first + len(host)]
            self.mirror.adopt_host_hits(request_id, hit_pages.host_mirror)
            self.mirror.load(request_id, host, loaded, "prefix_load")
            self.mirror.tier.metrics.host_prefix_hit_pages += len(host)
            self.host_hit_tokens += len(host) * self.page_size
            hashes = self._hashes[request_id]
            for i, page in enumerate(loaded, start=first):
                self.allocator.register(page, hashes[i])
        elif hit_pages and self.mirror is not None:
            self.mirror.adopt_host_hits(request_id, hit_pages.host_mirror)
        if hit_pages or host:
            self._num_registered[request_id] = len(hit_pages) + len(host)
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

    # ---- host tier -----------------------------------------------------------------
    def swap_out(self, request_id: str, num_computed: int) -> bool:
        """Move a preempted request's KV to host pages; False (nothing changed) when there
        is no host tier or it is full. Device pages are released (the store holds them
        until its copy completes)."""
        if self.mirror is None or num_computed == 0:
            return False
        if not self.mirror.store_missing(
            request_id,
            self.pages.get(request_id, []),
            self._hashes.get(request_id, []),
            num_computed,
            full_only=False,
        ):
            return False
        self.allocator.free(self.pages.pop(request_id, []))
        self._num_registered.pop(request_id, None)
        self.mirror.tier.metrics.swaps_out += 1
        return True

    def swap_in(self, request_id: str, num_computed: int, num_tokens: int) -> bool:
        """Give a swapped request device pages for num_tokens and load its computed ones."""
        if self.pages.get(request_id):
            raise RuntimeError(f"request {request_id} is swapped but holds device pages")
        need = self.pages_needed(num_tokens)
        if need > self.allocator.num_free:
            return False
        pages = self.allocator.allocate(need)
        self.pages[request_id] = pages
        k = self.pages_needed(num_computed)
        self.mirror.load(
            request_id, self.mirror.mirror(request_id).host_pages[:k], pages[:k], "swap_in"
        )
        self._num_registered[request_id] = 0
        self.mirror.tier.metrics.swaps_in += 1
        return True

    def after_step(self, computed: list[tuple[str, int, int]]) -> None:
        """Write-through after a step: (request id, start, n) for each computed range."""
        if self.mirror is None:
            return
        appends, registers = [], []
        for rid, start, n in computed:
            pages, hashes = self.pages[rid], self._hashes.get(rid, [])
            m = self.mirror.mirror(rid)
            if n == 1 and self.mirror.decode_append == "layer" and m.tokens > start:
                if (start + 1) % self.page_size == 0 and len(hashes) * self.page_size > start:
                    page = (start + 1) // self.page_size - 1
                    self.mirror.tier.host_alloc.register(m.host_pages[page], hashes[page])
                continue
            if n == 1 and self.mirror.decode_append == "batched":
                plan = self.mirror.append_plan(rid, start, 1, pages)
                if plan is not None:
                    appends += plan
                    if (start + 1) % self.page_size == 0 and len(hashes) * self.page_size > start:
                        page = (start + 1) // self.page_size - 1
                        registers.append((self.mirror.mirror(rid).host_pages[page], hashes[page]))
                    continue
            self.mirror.store_missing(rid, pages, hashes, start + n, full_only=True)
        if appends:
            self.mirror.tier.append_slots(
                [a for a, _ in appends], [b for _, b in appends], None, "decode append", registers
            )

    def layer_append_hook(self, decodes: list[tuple[str, int]]):
        """decode_append="layer": plan the mirroring of this step's decode tokens and
        return hook(layer) that copies one layer's slots right after its K/V write."""
        if self.mirror is None or self.mirror.decode_append != "layer":
            return None
        dev, host = [], []
        for rid, start in decodes:
            plan = self.mirror.append_plan(rid, start, 1, self.pages[rid])
            for a, b in plan or ():
                dev.append(a)
                host.append(b)
        if not dev:
            return None
        tier = self.mirror.tier
        return lambda layer: tier.append_slots(dev, host, layer, f"layer {layer} append")

    def take_step_loads(self) -> list:
        return self.mirror.take_step_loads() if self.mirror is not None else []

    # ---- release -------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release the request's pages (they stay findable by hash until evicted)."""
        self.allocator.free(self.pages.pop(request_id, []))
        self._num_registered.pop(request_id, None)
        if self.mirror is not None:
            self.mirror.release(request_id)

    def forget(self, request_id: str) -> None:
        """Drop everything kept for a finished request."""
        self.free(request_id)
        self._hashes.pop(request_id, None)

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free
