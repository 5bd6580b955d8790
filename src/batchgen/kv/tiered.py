"""TieredKVManager: the host tier's page lifecycle, with every copy through the CopyEngine.

A step's copies are queued while the scheduler plans it and submitted together by
`flush()` (one load task, one store task per kind), before the step's forward:

    schedule():  evictions -> queue_write_back   admissions -> queue_load
    flush():     [write-backs, swap-outs, stores ahead: gather pages on the compute
                 stream | D2H of the staging on a copy stream]  [write-throughs]
                 [load: wait stores it reads; per layer: H2D, scatter | gate l]
    forward:     layer l waits the load's gate l

Who may free or reuse a page:
- A load holds its host pages and its destination device pages (extra references,
  taken at queue time) until it completes: neither can be evicted or reallocated while
  the copy is in flight, whatever fails in between (rule 5 of kv/copy_rules.py). A
  load of host pages whose store is in flight waits for that store on the copy stream
  (rule 3a).
- A store's host pages join the host cache under their hashes when it is submitted
  (a layer-wise decode append's when it completes): a lookup finds them at once, and a
  load of them waits for the store on the copy stream. The store holds them until it
  completes. A write-through store also holds its source device pages until then.
- A write-back store copies a device page the allocator has just evicted and handed to
  a new owner. flush() gathers the page into staging on the compute stream, so the read
  comes after the page's last write and before anything queued later (the new owner's
  forward, a load into the page) writes it (rule 3d); the copy stream carries the staging, kept
  alive by the handle, to the host. Nothing waits on the store but a load of its host
  pages.
- A swap-out store (`queue_swap_out`, requests with a compressed state) is a write-back
  whose host pages the swapped request owns until its swap-in: they are allocated at
  queue time, kept at completion, and freed by `release_host`. A store ahead
  (`queue_store_ahead`) is a write-back of pages nobody has been handed yet.
Each copy is emitted as a plain record (`TierCopy`) and run by the tier's `CopyLedger`
(kv/copy_ledger.py: the one executor of copy records, on every rank: the submit, the
writing map a load waits on, rule 3a of kv/copy_rules.py, and the pending queue whose
completions release the pages, rule 5); tensor parallel sends the same records to the
workers. They complete in `poll()`, which the engine calls once per step, or `drain()`;
both complete the state tier's copies too (`states`, kv/state_tier.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from batchgen.config_groups import check_choice
from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.copy_ledger import CopyLedger, LayerStores, TierCopy
from batchgen.kv.copy_readback import KVReadbackError as KVReadbackError  # its old home
from batchgen.kv.host_pool import HostPool
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_copies import LOAD_STAGING_BYTES, num_runs
from batchgen.kv.page_pool import PagePool
from batchgen.kv.tier_metrics import TierMetrics
from batchgen.kv.tier_queue import Queued, TierQueue

if TYPE_CHECKING:
    from batchgen.kv.state_tier import StateTier

logger = logging.getLogger(__name__)


class LayerStoreHook:
    """decode_append="layer": one step's `on_kv_written`. hook(layer) copies that layer
    of `plan`'s pages to host right after the layer's K/V write; `plan` is plain data, so
    tensor parallel sends it to the workers with the step (TPStep.layer_stores)."""

    def __init__(self, tier: TieredKVManager, plan: LayerStores, hashes: list) -> None:
        self.tier, self.plan, self.hashes = tier, plan, hashes

    def __call__(self, layer: int) -> None:
        plan = self.plan
        self.tier.store_layer(plan.dev_pages, plan.host_pages, layer, self.hashes, plan.tags)


class TieredKVManager(TierQueue):
    """The host tier of pages: submits the queued copies (flush) and completes them over
    its ledger; the queueing and lookups are TierQueue's (kv/tier_queue.py)."""

    def __init__(
        self,
        device_pool: PagePool,
        host_pool: HostPool,
        device_alloc: PageAllocator,
        copies: CopyEngine,
        debug: bool = False,
        loads_pay: bool = True,
        load_scatter: str = "copy",
        metrics: TierMetrics | None = None,
        states: StateTier | None = None,
        mirrored: list[TierCopy] | None = None,
    ) -> None:
        """`metrics`: the counters, shared with `states` (the compressed-state slots' tier,
        if any; built first, on the same `copies`). `mirrored` (tensor parallel): the
        list each copy submitted is logged to, as plain data for the workers' mirrors
        (`states` logs its own to it too); None on one rank."""
        check_choice("tier_load_scatter", load_scatter)
        super().__init__()  # the step's queues
        # where a load's staged pages are scattered into the pool: on its copy stream, or
        # deferred to the compute stream (CopyHandle.defer), each group at the first wait
        # for its layers, so that no kernel runs on a copy stream
        self.load_scatter = load_scatter
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device_alloc = device_alloc
        self.host_alloc = PageAllocator(host_pool.num_pages, enable_caching=True)
        self.copies = copies
        self.debug = debug
        self.loads_pay = loads_pay  # the cost rule's verdict: load rather than recompute
        self.metrics = TierMetrics() if metrics is None else metrics
        # host pages: stores in flight writing them, copies to complete in order
        self.ledger = CopyLedger(
            copies,
            self.metrics,
            self.host_alloc.free,
            defers=load_scatter == "compute",
            checks=self.metrics if debug else None,
        )
        self._loading: dict[int, CopyHandle] = {}  # device page -> load in flight
        self.states = states
        self.mirrored = mirrored  # take_mirrored() hands them over

    @property
    def page_bytes(self) -> int:
        return self.device_pool.layout.bytes_per_page

    def attach_device(self, pool: PagePool | None, alloc: PageAllocator | None) -> None:
        """Point at a re-created device pool (None while it is being replaced)."""
        if (
            self.ledger.num_in_flight
            or self._loads.dev_pages
            or self._stores.dev_pages
            or self._swap_outs.dev_pages
            or self._ahead
        ):
            raise RuntimeError("the device pool changed with tier copies in flight")
        self.device_pool, self.device_alloc = pool, alloc

    def loads_of(self, dev_pages: list[int]) -> list[CopyHandle]:
        """Loads in flight that write any of `dev_pages` (a prefix hit on a page still
        being loaded must wait for it like the step that asked for the load)."""
        if not self._loading:  # most admissions: no load in flight to look through
            return []
        return list({id(h): h for p in dev_pages if (h := self._loading.get(p))}.values())

    # ---- submission --------------------------------------------------------------------
    def flush(self, stores_only: bool = False, defer_ahead: bool = False) -> list[CopyHandle]:
        """Submit the queued copies; returns the handles the step's forward must wait on
        (its loads). Stores of pages no longer held (write-backs, swap-outs, stores
        ahead) read their pages here, on the current stream, before anything queued
        later (the forward, a load) can write them: nothing waits on them.
        `defer_ahead`: the stores ahead stay queued for `flush_ahead()`, which the engine
        calls once the step's forward is launched. Their pages belong to nobody (a page
        reallocated first becomes a write-back of the step: `expedite`), so the forward
        cannot write them, and reading them after it keeps their issuing off the step's
        critical path."""
        waits = []
        if not self._has_queued(stores_only, defer_ahead):  # most steps: nothing to submit
            return waits
        q, self._stores = self._stores, Queued()
        for chunk in self._chunks(q):
            self._submit_store(chunk, hold_dev=True)
        if stores_only:
            return waits
        q, self._write_backs = self._write_backs, Queued()
        for chunk in self._chunks(q):
            self._submit_store(chunk, hold_dev=False)
        q, self._swap_outs = self._swap_outs, Queued()
        for chunk in self._chunks(q):
            self._submit_store(chunk, hold_dev=False)
        if not defer_ahead:
            self.flush_ahead()
        q, self._loads = self._loads, Queued()
        if q.dev_pages:
            if self.load_scatter == "compute":  # staging of every layer: at most so many pages
                pages = max(1, LOAD_STAGING_BYTES // self.page_bytes)
                waits += [self._submit_load(c) for c in self._chunks(q, pages)]
            else:
                waits.append(self._submit_load(q))
        return waits

    def flush_ahead(self) -> None:
        """Submit the queued stores ahead (gathered on the current stream, crossing on
        the background stream); nothing waits on them."""
        if not self._ahead:
            return
        ahead, self._ahead, q = self._ahead, {}, Queued()
        for page, (page_hash, tag) in ahead.items():
            q.add(page, page_hash, "swap_out", tag)
        for chunk in self._chunks(q):
            self._submit_store(chunk, hold_dev=False, background=True)

    def _submit_store(
        self, q: Queued, hold_dev: bool, background: bool = False
    ) -> CopyHandle | None:
        owned = bool(q.host_pages)  # a swap-out: host pages allocated at queue time, kept
        n = len(q.dev_pages) if owned else min(len(q.dev_pages), self.host_room())
        if n < len(q.dev_pages):
            logger.debug("host KV pool full: %d page(s) not offloaded", len(q.dev_pages) - n)
            self._note_storing(q.hashes[n:], -1)
            if hold_dev:
                self.device_alloc.free(q.dev_pages[n:])
        if n == 0:
            return None
        dev_pages, hashes = q.dev_pages[:n], q.hashes[:n]
        host_pages = q.host_pages if owned else self.host_alloc.allocate(n)
        copy = self._emit(TierCopy("store", dev_pages, host_pages, q.tags[:n]))
        # pages no longer held (a new owner may have them already) are read now, on this
        # (the compute) stream, so that whatever is queued after, a forward or a load,
        # writes them only after the read; their copy only carries staging to the host.
        # Held pages are read on the copy stream, unless load_scatter="compute" keeps
        # every tier kernel off the copy streams (config.EngineConfig)
        handle = self.ledger.store(
            copy,
            self._pools(),
            q.reasons[:n],
            lambda h: self._stored(host_pages, dev_pages, hashes, hold_dev, owned),
            gather=not hold_dev or self.load_scatter == "compute",
            background=background,
        )
        for page, h in zip(host_pages, hashes):
            if h is not None:  # a lookup finds it at once; a load of it waits for this store
                self.host_alloc.register(page, h)
        for reason, pages in Counter(q.reasons[:n]).items():
            self.metrics.count(reason, pages * self.page_bytes)
        self.metrics.pages_offloaded += n
        self.metrics.transfers += 1
        self.metrics.host_runs += num_runs(host_pages)
        return handle

    def _submit_load(self, q: Queued) -> CopyHandle:
        host_pages, dev_pages = q.host_pages, q.dev_pages
        copy = self._emit(TierCopy("load", dev_pages, host_pages, q.tags))
        handle = self.ledger.load(
            copy,
            self._pools(),
            q.reasons,
            lambda h: self._loaded(h, host_pages, dev_pages),
            defer=self.load_scatter == "compute",
        )
        for reason, pages in Counter(q.reasons).items():
            self.metrics.count(reason, pages * self.page_bytes)
        self.metrics.pages_loaded += len(host_pages)
        self.metrics.transfers += 1
        self.metrics.host_runs += num_runs(host_pages)
        for p in dev_pages:
            self._loading[p] = handle
        return handle

    def _emit(self, copy: TierCopy) -> TierCopy:
        """A copy this tier decided: logged for the workers' mirrors (tensor parallel),
        then run by the ledger here."""
        if self.mirrored is not None:
            self.mirrored.append(copy)
        return copy

    def _pools(self) -> tuple[PagePool, HostPool]:
        return self.device_pool, self.host_pool

    def take_mirrored(self) -> list[TierCopy]:
        """The copies submitted since the last call, in submission order (tensor
        parallel: sent to the workers before anything can reuse their pages). The list
        itself stays: the state tier logs to it too."""
        taken = list(self.mirrored)
        self.mirrored.clear()
        return taken

    def store_layer(
        self, dev_pages: list[int], host_pages: list[int], layer: int, hashes: list, tags: list
    ) -> None:
        """decode_append="layer": copy one layer of full pages to host pages the caller
        allocated, right after that layer's K/V write (called inside the forward). The
        last layer's completion registers `hashes` and releases the host pages."""
        last = layer == self.device_pool.kv.shape[0] - 1
        self.device_alloc.touch(dev_pages)
        if layer == 0:
            self._note_storing(hashes, 1)
        written, named = (host_pages, hashes) if last else ([], [])
        handle = self.ledger.store(
            TierCopy("store", dev_pages, host_pages, tags),
            self._pools(),
            ["decode_append"],
            lambda h: self._stored(written, dev_pages, named, True, False, register=True),
            layers=range(layer, layer + 1),
        )
        self.metrics.count("decode_append", handle.nbytes)
        self.metrics.appends += 1
        if last:
            self.metrics.pages_offloaded += len(dev_pages)

    # ---- completion (CopyLedger.poll / drain) -------------------------------------------
    def poll(self) -> None:
        """Complete every copy that has finished, in submission order. A load's scatter
        deferred to the compute stream runs at its step's forward; one a failed step
        left is queued here, before anything else can reuse its pages."""
        self.ledger.poll()
        if self.states is not None:
            self.states.poll()

    def drain(self) -> None:
        self.ledger.drain()
        if self.states is not None:
            self.states.drain()

    def _stored(self, host_pages, dev_pages, hashes, hold_dev, keep_host, register=False):
        """A store completed (its writing-map entries cleared, the owned host pages let go
        of meanwhile freed): a layer-wise store's hashes join the host cache; its host
        pages (unless its swapped request owns them) and held device pages are released."""
        if register:
            for page, h in zip(host_pages, hashes):
                if h is not None:
                    self.host_alloc.register(page, h)
        self._note_storing(hashes, -1)
        if not keep_host:
            self.host_alloc.free(host_pages)
        if hold_dev:
            self.device_alloc.free(dev_pages)

    def _loaded(self, handle: CopyHandle, host_pages: list[int], dev_pages: list[int]) -> None:
        """A load completed: its host pages and destination device pages are released."""
        for page in dev_pages:
            if self._loading.get(page) is handle:
                del self._loading[page]
        self.host_alloc.free(host_pages)
        self.device_alloc.free(dev_pages)

    @property
    def num_in_flight(self) -> int:
        states = 0 if self.states is None else self.states.num_in_flight
        return self.ledger.num_in_flight + states
