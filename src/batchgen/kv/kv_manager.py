"""Per-request page tables over the page allocator, with prefix-cache lookups and, when
a host tier is attached and loading pays, the host side of the cache.

Every unfinished request's full prompt pages are wanted (`demand`): free cached pages
someone wants are evicted only after those nobody wants (`PageAllocator`). With the tier
active, the device prefix cache and the host cache act as one: a preempted (swapped)
request's full pages are stored to host at its swap-out, off the critical path, while
they wait free but cached on the device; any other device page evicted while it is still
wanted is written back to host before its new owner writes it (the step's forward waits
for that copy, so it is kept to what a known request will load). So a swapped request
finds its full pages again on the device or on the host (only its last partial page is
recomputed), and a prefix that queued requests share outlives its running ones on the
host. Pages no one wants are dropped. Host prefix hits are loaded into new device pages
with the step's load.
"""

from __future__ import annotations

from collections.abc import Iterable

from batchgen.config_groups import check_choice
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.prefix_hash import hash_full_pages
from batchgen.kv.tier_mirror import LayerStores
from batchgen.kv.tiered import LayerStoreHook, TieredKVManager


class PrefixHit(list):
    """Device pages of a request's cached prefix; `host_pages` continue it from the host
    tier (loaded into new device pages at allocation)."""

    def __init__(self, device_pages=(), host_pages=()) -> None:
        super().__init__(device_pages)
        self.host_pages = list(host_pages)


class KVCacheManager:
    """Maps request ids to the pages holding their KV.

    A request's page list covers tokens [0, num_computed + num_new): page i holds
    tokens [i*page_size, (i+1)*page_size). Full pages are registered in the prefix
    cache once their tokens are computed.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        tier: TieredKVManager | None = None,
        decode_append: str = "off",
    ) -> None:
        """`allocator`: the device pool's bookkeeping (its `enable_caching` is whether
        prefixes are cached), the one `tier` holds too; `allocate` tells this manager of
        each cached page it evicts."""
        check_choice("decode_append", decode_append)
        self.page_size = page_size
        self.tier = tier
        self.decode_append = decode_append
        self._demand: dict[bytes, int] = {}  # unfinished requests whose pages these are
        self.allocator = allocator
        self.pages: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        # requests whose computed tokens fill a page not registered at their last check
        # (a token of it was in flight): `cache_computed_for` keeps it, the update of a
        # blind decode step checks these and the rows that reach a page's end only
        self.behind: set[str] = set()
        self._counted: dict[str, int] = {}  # per request: hashes counted in _demand
        self._swapped: dict[str, list[bytes]] = {}  # swapped request -> its cached pages
        self._swapped_by: dict[bytes, str] = {}  # page hash -> a swapped request holding it
        self._waits: list = []  # in-flight loads of device pages this step hit
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.host_hit_tokens = 0

    @property
    def tier_active(self) -> bool:
        """Host pages are kept and loaded (the cost rule says loading beats recompute)."""
        return self.tier is not None and self.tier.loads_pay and self.allocator.enable_caching

    def resize(self, num_pages: int) -> None:
        """A new, empty device pool of num_pages (after reconfigure): page tables and the
        device prefix cache start empty; hashes, demand, swapped requests and counters
        carry over. Only valid when no request holds pages."""
        if self.pages or self._waits:
            raise RuntimeError("resize() with requests holding device pages")
        self.allocator.resize(num_pages)
        self._num_registered.clear()
        self.behind.clear()

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_hashes(self, request_id: str, token_ids: list[int]) -> list[bytes]:
        """Chained hashes of the request's full pages (kept, extended as tokens grow)."""
        hashes = self._hashes.get(request_id)
        if hashes is None or len(hashes) < len(token_ids) // self.page_size:
            hashes = hash_full_pages(token_ids, self.page_size, hashes)
            self._hashes[request_id] = hashes
        return hashes

    def want(self, request_id: str, token_ids: list[int]) -> None:
        """Count the request's full pages as wanted until it finishes: a free cached page
        someone wants is evicted after those nobody wants, and written back to host if
        evicted all the same (tier active only)."""
        if self.allocator.enable_caching:
            self._want_hashes(request_id, self.page_hashes(request_id, token_ids))

    def _want_hashes(self, request_id: str, hashes: list[bytes]) -> None:
        """`want` for the request's known page hashes (those not counted yet)."""
        done = self._counted.get(request_id, 0)
        if done >= len(hashes):
            return
        demand = self._demand
        for h in hashes[done:]:
            n = demand.get(h, 0)
            demand[h] = n + 1
            if not n:
                self.allocator.want(h)
        self._counted[request_id] = len(hashes)

    def lookup_prefix(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """Cached pages for the request's longest hit; at least one token stays to compute."""
        hashes = self.page_hashes(request_id, token_ids)
        max_pages = (len(token_ids) - 1) // self.page_size
        device = self.allocator.lookup(hashes[:max_pages])
        if not self.tier_active or len(device) == max_pages:
            return PrefixHit(device)
        host = self.tier.lookup(hashes[len(device) : max_pages])
        return PrefixHit(device, host)

    def is_cached(self, page_hash: bytes) -> bool:
        """The page is in the device prefix cache or in the host tier's (no reference
        taken, no counter touched): for admission order."""
        if self.allocator.is_cached(page_hash):
            return True
        return self.tier_active and self.tier.host_alloc.is_cached(page_hash)

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
        Host hits get new device pages, filled by the step's load (the forward waits)."""
        held = self.pages.get(request_id)
        if (
            held is not None
            and len(held) * self.page_size >= num_tokens
            and not hit_pages
            and not getattr(hit_pages, "host_pages", None)
        ):
            return True  # already covered: most decode steps (checked first, ~900 a step)
        if held is None:
            held = []
        host = list(getattr(hit_pages, "host_pages", ()))
        need = self.pages_needed(num_tokens) - len(held) - len(hit_pages)
        if need <= 0 and not hit_pages and not host:
            return True  # already covered: most decode steps
        if need > self.allocator.num_free_after_touch(list(hit_pages)):
            return False
        if hit_pages:
            self.allocator.touch(list(hit_pages))
            self.prefix_hit_tokens += len(hit_pages) * self.page_size
            if self.tier is not None:
                self._waits += self.tier.loads_of(hit_pages)
        first = len(held) + len(hit_pages)
        # grown in place: the runner's page rows then write only the pages added
        held += list(hit_pages) + self.allocator.allocate(max(need, 0), self._evicted)
        self.pages[request_id] = held
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            self._resumed(request_id, swapped)
        if host:
            loaded = held[first : first + len(host)]
            reason = "swap_in" if swapped is not None else "prefix_load"
            self.tier.queue_load(host, loaded, reason, f"request {request_id}")
            self.tier.metrics.host_prefix_hit_pages += len(host)
            self.host_hit_tokens += len(host) * self.page_size
            hashes = self._hashes[request_id]
            for i, page in enumerate(loaded, start=first):
                self.allocator.register(page, hashes[i])
        if hit_pages or host:
            self._num_registered[request_id] = len(hit_pages) + len(host)
        return True

    def note_admission(self, num_tokens: int) -> None:
        """Count an admitted request's tokens toward the prefix-cache query total."""
        self.prefix_query_tokens += num_tokens

    def cache_computed_for(self, requests) -> None:
        """`cache_computed` for each of `requests` (each with request_id, token_ids and
        num_computed_tokens), in order: a step's rows, most of which fill no page (their
        check is made here, without a call a row). Keeps `behind`: a request left with
        fewer pages registered than its computed count fills."""
        if not self.allocator.enable_caching:
            return
        ps, registered, behind = self.page_size, self._num_registered.get, self.behind
        for req in requests:
            ids, rid, computed = req.token_ids, req.request_id, req.num_computed_tokens
            done = registered(rid, 0)
            if min(computed, len(ids)) // ps > done:
                self.cache_computed(rid, ids, computed)
                done = self._num_registered[rid]
            if computed // ps > done:
                behind.add(rid)
            elif behind:
                behind.discard(rid)

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register every full page whose tokens are all computed (and, with
        decode_append="batched", write it through to host). num_computed may count a
        position whose token is still in flight (async scheduling): its page waits."""
        if not self.allocator.enable_caching:
            return
        full = min(num_computed, len(token_ids)) // self.page_size
        done = self._num_registered.get(request_id, 0)
        if full <= done:
            return
        # a page's hash depends on its tokens only: those of pages not computed yet (a
        # prompt's, hashed at add) may be known already, and none is hashed twice
        hashes = self.page_hashes(request_id, token_ids)
        pages = self.pages[request_id]
        for i in range(done, full):
            self.allocator.register(pages[i], hashes[i])
        self._num_registered[request_id] = full
        if self.tier_active:
            self._want_hashes(request_id, hashes)
            if self.decode_append != "off":
                new = [i for i in range(done, full) if not self.tier.holds(hashes[i])]
                self.tier.queue_store(
                    [pages[i] for i in new],
                    [hashes[i] for i in new],
                    "write_through",
                    f"request {request_id}",
                )

    # ---- host tier -----------------------------------------------------------------
    def _evicted(self, page: int, page_hash: bytes) -> None:
        """The allocator reuses a cached page: keep its tokens on host if an unfinished
        request wants them (the step's flush reads the page before its forward runs).
        Wanted pages are evicted last (`PageAllocator`), and a swapped request's pages
        were stored ahead at its swap-out, so this is rare; a page nobody wants is not
        copied on the chance that a later call asks for it. A page whose store ahead was
        flushed already was read then, in stream order: nothing to do."""
        if self.tier is None:
            return
        if self.tier.expedite(page):
            return
        if self.tier_active and page_hash in self._demand:
            self._write_back(page, page_hash)

    def _write_back(self, page: int, page_hash: bytes) -> None:
        if self.tier.holds(page_hash):
            return
        owner = self._swapped_by.get(page_hash)
        reason = "swap_out" if owner is not None else "write_back"
        tag = f"request {owner}" if owner is not None else "a cached prefix page"
        self.tier.queue_write_back(page, page_hash, reason, tag)

    def swap_out(self, request_id: str, num_computed: int) -> bool:
        """Preempt a request keeping its KV: its full pages stay in the device cache for
        its resume and are stored to host ahead of any eviction (`queue_store_ahead`); False
        (nothing changed) when the tier is inactive or the host pool has no room for
        them."""
        if not self.tier_active or num_computed < self.page_size:
            return False
        hashes = self._hashes.get(request_id, [])[: num_computed // self.page_size]
        missing = [i for i, h in enumerate(hashes) if not self.tier.holds(h)]
        if len(missing) > self.tier.host_room():
            return False
        self._swapped[request_id] = hashes
        for h in hashes:
            self._swapped_by[h] = request_id
        pages = self.pages.pop(request_id, [])
        # pages holding their hash in the device cache: an eviction finds those only
        ahead = [i for i in missing if self.allocator.page_hash(pages[i]) == hashes[i]]
        if ahead:
            self.tier.queue_store_ahead(
                [pages[i] for i in ahead], [hashes[i] for i in ahead], f"request {request_id}"
            )
        self.allocator.free(pages)
        self._num_registered.pop(request_id, None)
        self.behind.discard(request_id)
        self.tier.metrics.swaps_out += 1
        return True

    def _resumed(self, request_id: str, hashes: list[bytes]) -> None:
        for h in hashes:
            if self._swapped_by.get(h) == request_id:
                del self._swapped_by[h]
        self.tier.metrics.swaps_in += 1

    def after_step(self) -> None:
        """Submit the write-through stores queued while the step's results were
        recorded (nothing waits on them but later loads of their host pages)."""
        if self.tier is not None:
            self.tier.flush(stores_only=True)

    def layer_store_hook(self, decodes: Iterable[tuple[str, int, list[int]]]):
        """decode_append="layer": for the decode tokens (request id, position, the
        request's tokens) that fill a page this step, return hook(layer) that copies that
        layer of those pages to host right after its K/V write; None when no page fills."""
        if not self.tier_active or self.decode_append != "layer":
            return None
        ps = self.page_size
        dev, hashes, tags = [], [], []
        for rid, start, token_ids in decodes:
            if (start + 1) % ps:
                continue
            i = start // ps  # the page this step's token fills: its tokens are all known
            page_hash = self.page_hashes(rid, token_ids[: start + 1])
            if i < len(page_hash) and not self.tier.holds(page_hash[i]):
                dev.append(self.pages[rid][i])
                hashes.append(page_hash[i])
                tags.append(f"request {rid}")
        room = min(len(dev), self.tier.host_room())
        if room == 0:
            return None
        dev, hashes, tags = dev[:room], hashes[:room], tags[:room]
        host = self.tier.host_alloc.allocate(room)
        return LayerStoreHook(self.tier, LayerStores(dev, host, tags), hashes)

    def keep_cached_on_host(self) -> None:
        """Before the device pool is dropped (reconfigure): queue the write-back of every
        device-cached page, wanted or not (a one-off, off any step's critical path), while
        the host has room: host prefixes survive the pool change."""
        if not self.tier_active:
            return
        for page, page_hash in self.allocator.cached_pages():
            self._write_back(page, page_hash)

    def take_step_copies(self, defer_ahead: bool = False) -> list:
        """Submit the copies the step planned; the handles its forward must wait on.
        `defer_ahead`: the swapped requests' stores ahead wait for `flush_ahead()`
        (TieredKVManager.flush)."""
        if self.tier is None:
            return []
        waits, self._waits = self.tier.flush(defer_ahead=defer_ahead) + self._waits, []
        return waits

    def flush_ahead(self) -> None:
        """Submit the stores ahead a step deferred (once its forward is launched)."""
        if self.tier is not None:
            self.tier.flush_ahead()

    # ---- release -------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release the request's pages (they stay findable by hash until evicted): a
        preemption for recompute, or the end of a request (forget)."""
        self.allocator.free(self.pages.pop(request_id, []))
        self._num_registered.pop(request_id, None)
        self.behind.discard(request_id)

    def forget(self, request_id: str) -> None:
        """Drop everything kept for a finished request (its demand first, so that its
        pages go back to the LRU queue in order, tail first)."""
        hashes = self._hashes.pop(request_id, [])
        demand, unwant = self._demand, self.allocator.unwant
        for h in hashes[: self._counted.pop(request_id, 0)]:
            left = demand[h] - 1
            if left:
                demand[h] = left
            else:
                del demand[h]
                unwant(h)
        self.free(request_id)
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            for h in swapped:
                if self._swapped_by.get(h) == request_id:
                    del self._swapped_by[h]

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free
