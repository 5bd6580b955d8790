"""TieredKVManager: the host tier's page lifecycle (lookup, prepare/complete load,
prepare/complete store, decode appends), with every copy through the CopyEngine.

Who may free or reuse a page:
- A device page read by a store, and a host page written by one, carry an extra
  reference (taken in prepare_store) until complete_store: neither can be freed,
  evicted or reallocated while the copy is in flight.
- A host page read by a load carries an extra reference until complete_load. A load
  of a host page whose store is still in flight waits for that store's completion
  event on the copy stream ("a host page is not read before its write completes").
- Compute that reads loaded device pages waits on the load handle first (the runner
  calls `wait_on_current_stream()` on every handle the step needs).
Handles complete in `poll()`, which the engine calls once per step, or `drain()`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.host_pool import HostPool
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_copies import (
    device_to_host_pages,
    device_to_host_slots,
    host_to_device_pages,
)
from batchgen.kv.page_pool import PagePool

logger = logging.getLogger(__name__)


class KVReadbackError(RuntimeError):
    """batchgen_debug found an offloaded page that differs from its device source."""


_OFFLOADS = ("write_through", "swap_out", "decode_append")  # TierMetrics reasons by direction
_LOADS = ("swap_in", "prefix_load")


@dataclass
class TierMetrics:
    pages_offloaded: int = 0
    pages_loaded: int = 0
    copy_seconds: float = 0.0
    appends: int = 0
    host_prefix_hit_pages: int = 0
    host_prefix_query_pages: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    recomputes: int = 0
    readback_checks: int = 0
    # bytes and copy-stream seconds by why they moved: write_through, swap_out (stores),
    # swap_in, prefix_load (loads), decode_append
    bytes_by_reason: dict[str, int] = field(default_factory=dict)
    seconds_by_reason: dict[str, float] = field(default_factory=dict)

    def count(self, reason: str, nbytes: int) -> None:
        self.bytes_by_reason[reason] = self.bytes_by_reason.get(reason, 0) + nbytes

    @property
    def bytes_offloaded(self) -> int:
        """Device -> host bytes: stores and decode appends."""
        return sum(self.bytes_by_reason.get(r, 0) for r in _OFFLOADS)

    @property
    def bytes_loaded(self) -> int:
        """Host -> device bytes."""
        return sum(self.bytes_by_reason.get(r, 0) for r in _LOADS)

    @property
    def gb_per_s(self) -> float:
        moved = self.bytes_offloaded + self.bytes_loaded
        return moved / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    @property
    def host_prefix_hit_rate(self) -> float:
        q = self.host_prefix_query_pages
        return self.host_prefix_hit_pages / q if q else 0.0

    def summary(self) -> dict:
        """The counters engine.metrics() reports, traffic by reason as bytes_<reason> and
        copy_seconds_<reason>."""
        out = dict(
            swaps_out=self.swaps_out,
            swaps_in=self.swaps_in,
            pages_offloaded=self.pages_offloaded,
            pages_loaded=self.pages_loaded,
            bytes_offloaded=self.bytes_offloaded,
            bytes_loaded=self.bytes_loaded,
            copy_gb_per_s=self.gb_per_s,
            host_prefix_hit_pages=self.host_prefix_hit_pages,
            host_prefix_hit_rate=self.host_prefix_hit_rate,
            readback_checks=self.readback_checks,
        )
        for reason, nbytes in self.bytes_by_reason.items():
            out[f"bytes_{reason}"] = nbytes
            out[f"copy_seconds_{reason}"] = self.seconds_by_reason.get(reason, 0.0)
        return out


@dataclass
class _Pending:
    handle: CopyHandle
    kind: str  # "load" | "store" | "append"
    host_pages: list[int]
    dev_pages: list[int] = field(default_factory=list)
    hashes: list[bytes | None] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # per page: slots that were copied
    tag: str = ""
    finish: object = None  # callable run on completion (append scatter)
    reason: str = ""  # a TierMetrics reason


class TieredKVManager:
    def __init__(
        self,
        device_pool: PagePool,
        host_pool: HostPool,
        device_alloc: PageAllocator,
        copies: CopyEngine,
        debug: bool = False,
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device_alloc = device_alloc
        self.host_alloc = PageAllocator(host_pool.num_pages, enable_caching=True)
        self.copies = copies
        self.debug = debug
        self.metrics = TierMetrics()
        self._pending: deque[_Pending] = deque()
        self._writing: dict[int, CopyHandle] = {}  # host page -> store in flight

    @property
    def page_bytes(self) -> int:
        return self.device_pool.layout.bytes_per_page

    # ---- lookup -------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Host pages of the longest cached prefix of `hashes` (no reference taken)."""
        self.metrics.host_prefix_query_pages += len(hashes)
        return self.host_alloc.lookup(hashes)

    # ---- loads: host -> device ------------------------------------------------------
    def prepare_load(
        self, host_pages: list[int], dev_pages: list[int], tag: str, reason: str = "prefix_load"
    ) -> CopyHandle:
        """Copy host pages into (held) device pages; host pages stay referenced until
        complete_load. The caller's compute must wait on the returned handle."""
        wanted = set(host_pages)
        if any(q.kind == "append" and wanted & set(q.host_pages) for q in self._pending):
            self.drain()  # appends fill host pages on the host side, at completion
        self.host_alloc.touch(host_pages)
        after = [self._writing[p] for p in host_pages if p in self._writing]
        host_kv, dev_kv = self.host_pool.kv, self.device_pool.kv

        def copy():
            for h in after:
                h.wait_on_current_stream()
            return host_to_device_pages(host_kv, dev_kv, host_pages, dev_pages)

        handle = self._submit("load", len(host_pages), copy)
        self._pending.append(
            _Pending(handle, "load", list(host_pages), list(dev_pages), tag=tag, reason=reason)
        )
        self.metrics.pages_loaded += len(host_pages)
        self.metrics.count(reason, len(host_pages) * self.page_bytes)
        return handle

    def complete_load(self, p: _Pending) -> None:
        self.host_alloc.free(p.host_pages)

    # ---- stores: device -> host -----------------------------------------------------
    def prepare_store(
        self,
        dev_pages: list[int],
        host_pages: list[int],
        hashes: list[bytes | None],
        num_tokens: list[int],
        tag: str,
        reason: str = "write_through",
    ) -> CopyHandle:
        """Copy device pages into host pages the caller holds. Both stay referenced by
        the copy until complete_store, which registers `hashes` in the host cache."""
        self.device_alloc.touch(dev_pages)
        self.host_alloc.touch(host_pages)
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        handle = self._submit(
            "store",
            len(dev_pages),
            lambda: device_to_host_pages(dev_kv, host_kv, dev_pages, host_pages),
        )
        for p in host_pages:
            self._writing[p] = handle
        self._pending.append(
            _Pending(
                handle,
                "store",
                list(host_pages),
                list(dev_pages),
                list(hashes),
                list(num_tokens),
                tag,
                reason=reason,
            )
        )
        self.metrics.pages_offloaded += len(dev_pages)
        self.metrics.count(reason, len(dev_pages) * self.page_bytes)
        return handle

    def complete_store(self, p: _Pending) -> None:
        if self.debug:
            self._readback(p)
        for page, h in zip(p.host_pages, p.hashes):
            if self._writing.get(page) is p.handle:
                del self._writing[page]
            if h is not None:
                self.host_alloc.register(page, h)
        self.device_alloc.free(p.dev_pages)
        self.host_alloc.free(p.host_pages)

    # ---- decode appends: token slots -> host pages ------------------------------------
    def append_slots(
        self,
        dev_slots: list[int],
        host_slots: list[int],
        layer: int | None,
        tag: str,
        register: list[tuple[int, bytes]] = (),
    ) -> CopyHandle:
        """Mirror freshly written token slots (all layers, or one layer right after its
        K/V write) into host slots. Host pages are filled when the copy completes; then
        `register` (host page, hash) pairs of pages it completed join the host cache."""
        layout = self.device_pool.layout
        nl = layout.num_layers if layer is None else 1
        pin = self.device_pool.device.type == "cuda"
        pinned = torch.empty(
            (len(dev_slots), nl, 2, layout.num_kv_heads, layout.head_dim),
            dtype=layout.dtype,
            pin_memory=pin,
        )
        dev_kv = self.device_pool.kv
        handle = self._submit(
            "append", 0, lambda: device_to_host_slots(dev_kv, dev_slots, layer, pinned)
        )
        s = layout.page_size
        pages = sorted({h // s for h in host_slots})
        dev_pages = sorted({d // s for d in dev_slots})
        self.host_alloc.touch(pages)
        self.device_alloc.touch(dev_pages)
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        host_kv = self.host_pool.kv

        def finish() -> None:
            for i, slot in enumerate(host_slots):
                host_kv[slot // s, layers, :, slot % s] = pinned[i]
            if self.debug:
                self._readback_slots(dev_slots, host_slots, layers, tag)
            for page, h in register:
                self.host_alloc.register(page, h)
            self.device_alloc.free(dev_pages)

        self._pending.append(
            _Pending(handle, "append", pages, tag=tag, finish=finish, reason="decode_append")
        )
        self.metrics.appends += 1
        self.metrics.count("decode_append", pinned.numel() * pinned.element_size())
        return handle

    # ---- completion -------------------------------------------------------------------
    def _submit(self, kind: str, pages: int, copy) -> CopyHandle:
        holder: list = []
        handle = self.copies.submit(kind, pages * self.page_bytes, lambda: holder.append(copy()))
        handle.keep = (holder,)
        return handle

    def poll(self) -> None:
        """Complete every copy that has finished, in submission order."""
        while self._pending and self._pending[0].handle.is_done():
            self._complete(self._pending.popleft())

    def drain(self) -> None:
        while self._pending:
            p = self._pending.popleft()
            p.handle.synchronize()
            self._complete(p)

    def _complete(self, p: _Pending) -> None:
        p.handle.synchronize()
        seconds = p.handle.copy_seconds()
        self.metrics.copy_seconds += seconds
        by_reason = self.metrics.seconds_by_reason
        by_reason[p.reason] = by_reason.get(p.reason, 0.0) + seconds
        if p.kind == "load":
            self.complete_load(p)
        elif p.kind == "store":
            self.complete_store(p)
        else:
            p.finish()
            self.host_alloc.free(p.host_pages)
        p.handle.keep = ()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def _readback_slots(self, dev_slots, host_slots, layers, tag: str) -> None:
        s = self.device_pool.layout.page_size
        flat = self.device_pool.kv[layers].flatten(2, 3)
        src = flat[:, :, torch.tensor(dev_slots, device=flat.device)].cpu()
        for i, slot in enumerate(host_slots):
            self.metrics.readback_checks += 1
            dst = self.host_pool.kv[slot // s, layers, :, slot % s]
            if not torch.isfinite(dst.float()).all() or not torch.equal(src[:, :, i], dst):
                raise KVReadbackError(
                    f"{tag}: appended slot {dev_slots[i]} (device page {dev_slots[i] // s}) "
                    f"differs from host page {slot // s} or is not finite"
                )

    def _readback(self, p: _Pending) -> None:
        """batchgen_debug: compare each stored host page with its device source."""
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        for dev, host, n in zip(p.dev_pages, p.host_pages, p.num_tokens):
            src = dev_kv[:, :, dev, :n].cpu()
            dst = host_kv[host, :, :, :n]
            self.metrics.readback_checks += 1
            if not torch.isfinite(dst.float()).all():
                raise KVReadbackError(f"{p.tag}: non-finite KV in offloaded page {dev}")
            if not torch.equal(src, dst):
                bad = (src != dst).flatten(1).any(-1).nonzero()[0, 0].item()
                raise KVReadbackError(
                    f"{p.tag}: layer {bad} of device page {dev} differs from its host copy "
                    f"(host page {host})"
                )
