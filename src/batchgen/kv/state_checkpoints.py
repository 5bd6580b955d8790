"""StateCheckpoints: prefix hits for hybrid models, from host copies of the compressed
state taken at page-aligned positions.

A hybrid request's prefix hit needs its full-attention pages and its KDA state at the
same token. Pages are cached by the hash chain of their tokens (kv_manager.py); the state
after token P is cached here, in a host slot of the state tier, under the hash of the
page that ends at P, so both name the same prefix.

    positions  multiples of `interval` tokens (a multiple of the page size) at least two
               tokens before a request's end (so it is still in its prefill there)
    shared     by default a position is stored only where another request the engine
               holds (waiting or running) has the same prefix up to it (`track`): a
               position past the shared part of a prompt would cost a copy and a host
               slot and serve no hit (W3 on the W6 model: 2,048 of 2,752 checkpoints).
               shared_only=False stores every position, for sharing that arrives later
               (a request per generate() call, say)
    take       schedule() cuts a prefill chunk so it ends at the next wanted position
               nobody has stored; at the start of the next schedule() the request's slot is
               copied to host (StateTier.checkpoint_out), and that step waits for the
               slot's gather into device staging before its forward writes the slot
    hit        admission looks up the longest cached page prefix (device or host), cut to
               its longest checkpoint; the request takes a slot, the checkpoint is loaded
               into it (StateTier.checkpoint_in, the step waits) and it starts at P

Host slots are shared with swaps: checkpoints hold at most `max_slots` of them, the
least recently used given up first (never one a load is reading); a swap that finds no
free host slot takes one back from here (`make_room`).
"""

from __future__ import annotations

from collections import OrderedDict

from batchgen.config_groups import check_checkpoint_interval
from batchgen.kv.copy_engine import CopyHandle
from batchgen.kv.state_tier import StateTier


class StateCheckpoints:
    def __init__(
        self,
        states: StateTier,
        interval: int,
        page_size: int,
        max_slots: int,
        shared_only: bool = True,
    ) -> None:
        check_checkpoint_interval(interval, page_size)
        if not interval:
            raise ValueError("state_checkpoint_interval 0 stores no checkpoints: build none")
        self.states = states
        self.interval = interval
        self.page_size = page_size
        self.max_slots = max_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # page hash -> host slot, LRU
        self.shared_only = shared_only
        self._holders: dict[bytes, int] = {}  # position's page hash -> requests tracked
        self._tracked: dict[str, list[bytes]] = {}  # request id -> its positions' hashes
        self.num_stored = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._slots)

    def has(self, page_hash: bytes) -> bool:
        return page_hash in self._slots

    def track(self, request_id: str, hashes: list[bytes], num_tokens: int) -> None:
        """A request the engine now holds (num_tokens of prompt, `hashes` its full pages'
        chained hashes): its positions count toward `wanted` until `untrack`."""
        if not self.shared_only:
            return
        self.untrack(request_id)  # counted once, whatever was tracked under the id before
        step = self.interval // self.page_size
        last = max(0, num_tokens - 2) // self.interval * step  # positions < num_tokens - 1
        keys = hashes[step - 1 : last : step]
        self._tracked[request_id] = keys
        for key in keys:
            self._holders[key] = self._holders.get(key, 0) + 1

    def untrack(self, request_id: str) -> None:
        """The request ended (finished or aborted): its positions no longer count."""
        for key in self._tracked.pop(request_id, ()):
            n = self._holders[key] - 1
            if n:
                self._holders[key] = n
            else:
                del self._holders[key]

    def wanted(self, page_hash: bytes) -> bool:
        """Whether the position ending with that page is worth storing: always with
        shared_only False, else when two or more tracked requests reach it."""
        return not self.shared_only or self._holders.get(page_hash, 0) >= 2

    def next_position(self, computed: int, num_tokens: int) -> int | None:
        """The first checkpoint position after `computed` that leaves the request at
        least two tokens to compute (a checkpoint at P holds the state after tokens
        [0, P); a request is stored there while its prefill runs), or None."""
        pos = (computed // self.interval + 1) * self.interval
        return pos if pos < num_tokens - 1 else None

    def cut(self, computed: int, n: int, num_tokens: int, hashes: list[bytes]) -> int:
        """n, or fewer so that the chunk [computed, computed + n) ends at the first
        position inside it whose checkpoint is missing and wanted (a chunk never runs
        past one; positions already stored or wanted by nobody are run through)."""
        pos = self.next_position(computed, num_tokens)
        while pos is not None and pos < computed + n:
            key = hashes[pos // self.page_size - 1]
            if not self.has(key) and self.wanted(key):
                return pos - computed
            pos = self.next_position(pos, num_tokens)
        return n

    def take(
        self, dev_slot: int, computed: int, hashes: list[bytes], tag: str
    ) -> CopyHandle | None:
        """Store the slot's state if `computed` is a position whose checkpoint is missing
        and wanted, and a host slot can be had; the handle the next step waits on, else
        None."""
        if not computed or computed % self.interval or computed // self.page_size > len(hashes):
            return None
        key = hashes[computed // self.page_size - 1]
        if key in self._slots or not self.wanted(key) or not self._room():
            return None
        host_slot = self.states.take_host_slot()
        self._slots[key] = host_slot
        self.num_stored += 1
        return self.states.checkpoint_out(dev_slot, host_slot, tag)

    def longest(self, hashes: list[bytes], max_pages: int) -> int:
        """Pages of the longest prefix of `hashes[:max_pages]` with a checkpoint at its
        end (0 for none)."""
        step = self.interval // self.page_size
        for pages in range(max_pages // step * step, 0, -step):
            if hashes[pages - 1] in self._slots:
                return pages
        return 0

    def load(self, page_hash: bytes, dev_slot: int, num_tokens: int) -> CopyHandle:
        """Load the checkpoint under `page_hash` into `dev_slot` (a hit of num_tokens)."""
        self._slots.move_to_end(page_hash)
        self.hit_tokens += num_tokens
        return self.states.checkpoint_in(self._slots[page_hash], dev_slot)

    def make_room(self) -> bool:
        """Give the least recently used checkpoint's host slot back (for a swap); False
        when none can go now."""
        for key, host_slot in self._slots.items():
            if self.states.free_host_slot(host_slot):
                del self._slots[key]
                return True
        return False

    def _room(self) -> bool:
        """A host slot for one more checkpoint: a free one while under `max_slots`, else
        the least recently used checkpoint's."""
        if len(self._slots) < self.max_slots and self.states.host_room:
            return True
        return bool(self._slots) and self.make_room() and bool(self.states.host_room)
