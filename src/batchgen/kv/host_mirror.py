"""Per-request host mirrors: what of each request's KV also lives in host pages.

    device pages:  | p0 | p1 | p2 | p3 (partial) |
    host mirror:   | h0 | h1 |                       mirrored_tokens = 2 * page_size
A request's mirror is a prefix of its pages, with references held on the host pages.
It grows by write-through stores of full pages after each step ("prefill offload"),
by decode appends of fresh tokens (batched after the step, or per layer inside the
forward), and by a store of whatever is missing when the request is swapped out.
Full mirrored pages are registered by hash in the host cache, so they outlive the
request as host prefix hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.kv.copy_engine import CopyHandle
from batchgen.kv.tiered import TieredKVManager


@dataclass
class Mirror:
    host_pages: list[int] = field(default_factory=list)
    tokens: int = 0  # tokens whose KV is in host pages (copies may be in flight)


class HostMirror:
    def __init__(self, tier: TieredKVManager, page_size: int, decode_append: str) -> None:
        if decode_append not in ("off", "batched", "layer"):
            raise ValueError(f"decode_append must be off, batched or layer, got {decode_append!r}")
        self.tier = tier
        self.page_size = page_size
        self.decode_append = decode_append
        self.mirrors: dict[str, Mirror] = {}
        self.step_loads: list[CopyHandle] = []

    def mirror(self, rid: str) -> Mirror:
        return self.mirrors.setdefault(rid, Mirror())

    def _host_pages(self, n: int) -> list[int] | None:
        if self.tier.host_alloc.num_free < n:
            return None
        return self.tier.host_alloc.allocate(n)

    def adopt_host_hits(self, rid: str, host_pages: list[int]) -> None:
        """A fresh request whose first pages are cached in host: hold them as its mirror."""
        self.tier.host_alloc.touch(host_pages)
        m = self.mirror(rid)
        m.host_pages = list(host_pages)
        m.tokens = len(host_pages) * self.page_size

    def load(self, rid: str, host_pages: list[int], dev_pages: list[int], reason: str) -> None:
        """Queue a load of host pages into device pages (reason: prefix_load or swap_in)."""
        if host_pages:
            self.step_loads.append(
                self.tier.prepare_load(host_pages, dev_pages, f"request {rid}", reason)
            )

    def store_missing(
        self, rid: str, dev_pages: list[int], hashes: list[bytes], num_tokens: int, full_only: bool
    ) -> bool:
        """Store the pages covering tokens [mirror.tokens, num_tokens) (only full pages
        when full_only). False, storing nothing, when the host pool is out of pages."""
        ps = self.page_size
        m = self.mirror(rid)
        end_page = num_tokens // ps if full_only else -(-num_tokens // ps)
        first = m.tokens // ps  # a partially mirrored page is stored again, whole
        if end_page <= first:
            return True
        new = self._host_pages(end_page - len(m.host_pages))
        if new is None:
            return False
        pages = m.host_pages + new
        ntoks = [min(ps, num_tokens - i * ps) for i in range(first, end_page)]
        page_hashes = [
            hashes[i] if i < len(hashes) and ntoks[i - first] == ps else None
            for i in range(first, end_page)
        ]
        self.tier.prepare_store(
            dev_pages[first:end_page],
            pages[first:end_page],
            page_hashes,
            ntoks,
            f"request {rid}",
            "write_through" if full_only else "swap_out",
        )
        m.host_pages = pages
        m.tokens = max(m.tokens, min(num_tokens, end_page * ps))
        return True

    def append_plan(
        self, rid: str, start: int, n: int, dev_pages: list[int]
    ) -> list[tuple[int, int]] | None:
        """(device slot, host slot) pairs mirroring tokens [start, start + n), adding host
        pages as needed; None when the mirror is not contiguous with them or host is full."""
        ps = self.page_size
        m = self.mirror(rid)
        if m.tokens != start:
            return None
        need = -(-(start + n) // ps) - len(m.host_pages)
        if need > 0:
            new = self._host_pages(need)
            if new is None:
                return None
            m.host_pages += new
        m.tokens = start + n
        return [
            (dev_pages[t // ps] * ps + t % ps, m.host_pages[t // ps] * ps + t % ps)
            for t in range(start, start + n)
        ]

    def release(self, rid: str) -> None:
        m = self.mirrors.pop(rid, None)
        if m is not None:
            self.tier.host_alloc.free(m.host_pages)

    def take_step_loads(self) -> list[CopyHandle]:
        loads, self.step_loads = self.step_loads, []
        return loads
