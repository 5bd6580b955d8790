"""TierQueue: the host tier's side that the scheduler talks to while it plans a step
(kv/tiered.py's TieredKVManager derives from it): host cache lookups, and the step's
copies queued, to be submitted together by `TieredKVManager.flush()` before the step's
forward.

    queue_load         host pages -> new device pages (prefix hit, swap-in); both held
    queue_store        write-through of held full device pages (decode append)
    queue_write_back   an evicted page, already handed to a new owner
    queue_swap_out     a request's pages, to host pages it owns until its swap-in
    queue_store_ahead  a swapped request's free cached pages (`expedite`: reallocated
                       before the flush, one becomes a write-back)

A hash queued or in flight to host counts as held (`holds`): nothing stores it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PAGES_PER_COPY = 256  # bounds a store's device staging (all layers of n pages)


@dataclass
class Queued:
    """Copies of one kind queued for the step, a page each: its device page, its host
    page (loads and swap-outs; the others take one at submission), hash, reason, tag."""

    dev_pages: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    hashes: list[bytes | None] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)  # whose page it is, for error messages

    def add(self, dev_page: int, page_hash: bytes, reason: str, tag: str) -> None:
        """One device page to copy to a host page allocated at submission."""
        self.dev_pages.append(dev_page)
        self.hashes.append(page_hash)
        self.reasons.append(reason)
        self.tags.append(tag)


class TierQueue:
    """The step's queued copies and the host cache lookups. Its subclass sets
    `host_alloc`, `device_alloc`, `metrics` and `ledger` (kv/copy_ledger.py)."""

    def __init__(self) -> None:
        self._ahead: dict[int, tuple[bytes, str]] = {}  # stores ahead: page -> (hash, tag)
        self._storing: dict[bytes, int] = {}  # hashes queued or in flight to host
        self._loads = Queued()
        self._stores = Queued()  # write-through: sources held
        self._write_backs = Queued()  # evicted sources: read by flush() on the compute stream
        self._swap_outs = Queued()  # freed sources, host pages owned: like write-backs

    # ---- lookups ---------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Host pages of the longest cached prefix of `hashes` (no reference taken)."""
        self.metrics.host_prefix_query_pages += len(hashes)
        return self.host_alloc.lookup(hashes)

    def holds(self, page_hash: bytes) -> bool:
        """The host cache has (or is writing) the page `page_hash` names."""
        return page_hash in self._storing or self.host_alloc.is_cached(page_hash)

    def host_room(self) -> int:
        """Host pages a store could take now (free, or cached and evictable)."""
        return self.host_alloc.num_free

    # ---- queueing (copies of the step being planned) -------------------------------------
    def queue_load(
        self, host_pages: list[int], dev_pages: list[int], reason: str, tag: str
    ) -> None:
        """Copy host pages into device pages with the step's load. Both are held until
        the load completes; the forward waits on it layer by layer."""
        self.host_alloc.touch(host_pages)
        self.device_alloc.touch(dev_pages)
        q = self._loads
        q.host_pages += host_pages
        q.dev_pages += dev_pages
        q.reasons += [reason] * len(host_pages)
        q.tags += [tag] * len(host_pages)

    def queue_store(self, dev_pages: list[int], hashes: list[bytes], reason: str, tag: str) -> int:
        """Write full device pages through to new host pages, registered under `hashes`
        when submitted (a load of them waits for the store). The device pages are held
        until it completes. Returns pages queued (fewer when the host pool is out of
        room)."""
        room = min(len(dev_pages), self.host_room())
        self.device_alloc.touch(dev_pages[:room])
        q = self._stores
        q.dev_pages += dev_pages[:room]
        q.hashes += hashes[:room]
        self._note_storing(hashes[:room], 1)
        q.reasons += [reason] * room
        q.tags += [tag] * room
        return room

    def queue_store_ahead(self, dev_pages: list[int], hashes: list[bytes], tag: str) -> None:
        """Copy a swapped request's full pages to host while they wait free but cached on
        the device for its resume: an eviction later finds them on host and copies
        nothing. The device pages are not held (the preemption freed them for others).
        flush() gathers them on the compute stream, then their transfer runs on the
        background stream, where nothing a step waits on queues behind it; a page
        reallocated before the flush becomes a write-back of that step (`expedite`).
        The caller checks host_room()."""
        self._note_storing(hashes, 1)
        for page, h in zip(dev_pages, hashes):
            self._ahead[page] = (h, tag)

    def expedite(self, dev_page: int) -> bool:
        """A page queued for a store ahead is reallocated before flush(): it becomes a
        write-back of this step (read before the step's forward). False if not queued."""
        entry = self._ahead.pop(dev_page, None)
        if entry is None:
            return False
        page_hash, tag = entry
        self._write_backs.add(dev_page, page_hash, "swap_out", tag)  # already noted storing
        return True

    def queue_swap_out(self, dev_pages: list[int], tag: str) -> list[int]:
        """Copy a request's pages, its last partial one too, to host pages it owns until
        its swap-in (`queue_load`, then `release_host`); the caller checks host_room().
        For a request whose compressed state resumes at its exact position: it cannot
        recompute a partial page (its linear-attention layers would see those tokens
        twice). The caller frees the device pages at once: as with a write-back, flush()
        reads them on the compute stream before anything queued later writes them."""
        host_pages = self.host_alloc.allocate(len(dev_pages))
        q = self._swap_outs
        q.dev_pages += dev_pages
        q.host_pages += host_pages
        q.hashes += [None] * len(dev_pages)
        q.reasons += ["swap_out"] * len(dev_pages)
        q.tags += [tag] * len(dev_pages)
        return host_pages

    def release_host(self, host_pages: list[int]) -> None:
        """A swapped request lets go of its host pages (its swap-in's load holds them, or
        it ended): each is freed now, or once the store writing it completes."""
        for p in host_pages:
            self.ledger.release(p)

    def queue_write_back(self, dev_page: int, page_hash: bytes, reason: str, tag: str) -> None:
        """Copy an evicted (already reallocated) device page to host before its new owner
        writes it: flush() reads it on the compute stream, ahead of the step's forward."""
        self._write_backs.add(dev_page, page_hash, reason, tag)
        self._note_storing([page_hash], 1)

    def _note_storing(self, hashes: list, delta: int) -> None:
        for h in hashes:
            if h is None:
                continue
            left = self._storing.get(h, 0) + delta
            if left > 0:
                self._storing[h] = left
            else:
                self._storing.pop(h, None)

    def _has_queued(self, stores_only: bool, defer_ahead: bool = False) -> bool:
        if self._stores.dev_pages:
            return True
        if stores_only:
            return False
        return bool(
            self._write_backs.dev_pages
            or self._swap_outs.dev_pages
            or self._loads.dev_pages
            or (self._ahead and not defer_ahead)
        )

    def _chunks(self, q: Queued, pages: int = MAX_PAGES_PER_COPY):
        for i in range(0, len(q.dev_pages), pages):
            s = slice(i, i + pages)
            yield Queued(q.dev_pages[s], q.host_pages[s], q.hashes[s], q.reasons[s], q.tags[s])
