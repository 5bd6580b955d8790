"""The copy bodies the CopyEngine runs on a copy stream. Each returns what it must keep
alive until its completion event fires (rule 5).

    device pool  dev_kv  [L, C, P,  S, H, D]   (layer, component, page, slot, head, dim)
    host pool    host_kv [L, Ph, C, S, H, D]   layer-major: a run of consecutive host
                                               pages of one layer is one contiguous block
C is the layout's component count (2: K and V; 1: an MLA latent); nothing here depends
on it, nor on what a component holds, nor on its dtype: FP8 pages (kv_cache_dtype "fp8")
are gathered and scattered as their bytes (`kv_quant.raw`).
A transfer moves, per layer, one block per run of consecutive host pages through a
device staging tensor; the device side gathers or scatters pages with one kernel. The
pages are taken in host-page order (the device side's index follows it), so pages whose
host ids run backwards or interleave, as a sequence evicted tail first leaves them, still
cross in long blocks instead of one small copy per page and layer. Each index goes up
through pinned memory (`forward_context.to_device`): for an upload from pageable memory
CUDA may stage the data through its own pinned buffer and synchronise with the stream
first (on the compute stream, wait for the step in flight), which would stall the
decode pipeline at a store.

Compressed-state slots of linear-attention layers (state_pool.py) cross the same way, a
slot standing for a page:

    device  states [L, slots, H, Dv, Dk]   windows [L, slots, K - 1, C]
    host    states [L, slots_h, H, Dv, Dk] windows [L, slots_h, K - 1, C]  (layer-major)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from batchgen.forward_context import to_device
from batchgen.kv_quant import raw


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index into pages, first page, length) for each run of consecutive page ids."""
    runs, i = [], 0
    while i < len(pages):
        j = i + 1
        while j < len(pages) and pages[j] == pages[j - 1] + 1:
            j += 1
        runs.append((i, pages[i], j - i))
        i = j
    return runs


def num_runs(host_pages: list[int]) -> int:
    """The blocks a transfer of `host_pages` moves a layer: its runs of consecutive ids."""
    return len(_runs(sorted(host_pages)))


def _by_host_page(host_pages: list[int], dev_pages: list[int]) -> tuple[list, list]:
    """Both lists reordered by host page id (pairs kept together)."""
    if all(a < b for a, b in zip(host_pages, host_pages[1:])):
        return host_pages, dev_pages
    pairs = sorted(zip(host_pages, dev_pages))
    return [h for h, _ in pairs], [d for _, d in pairs]


def device_to_host_pages(
    dev_kv: torch.Tensor,
    host_kv: torch.Tensor,
    dev_pages: list[int],
    host_pages: list[int],
    layers: range | None = None,
    on_read: Callable[[], None] | None = None,
) -> tuple:
    """Device pages -> host pages, every layer or `layers`. The source pages are
    gathered into staging by one kernel, then `on_read()` (they may be overwritten
    from then on), then each layer's runs cross to the host."""
    layers = range(dev_kv.shape[0]) if layers is None else layers
    staged = gather_pages(dev_kv[layers.start : layers.stop], dev_pages, host_pages)
    if on_read is not None:
        on_read()
    return _device_to_host_runs(staged, host_kv, sorted(host_pages), layers)


def gather_pages(dev_kv: torch.Tensor, dev_pages: list[int], host_pages: list[int]) -> torch.Tensor:
    """The device pages of every layer of `dev_kv`, gathered by one kernel on the current
    stream into new staging [L, n, C, S, H, D], ordered by their host pages. It copies
    nothing to the host: on the compute stream it reads the pages in stream order, after
    the step that last wrote them and before anything queued later can write them;
    `device_to_host_staged`, submitted after it, takes the staging to the host."""
    _, dev_pages = _by_host_page(host_pages, dev_pages)
    idx = to_device(torch.tensor(dev_pages, dtype=torch.int64), dev_kv.device)
    # pages picked from the [L, P, C, ...] view: the output comes out [L, n, C, ...] and
    # contiguous from the one kernel (.contiguous() copies nothing then)
    return raw(dev_kv).transpose(1, 2).index_select(1, idx).contiguous().view(dev_kv.dtype)


def device_to_host_staged(
    staged: torch.Tensor, host_kv: torch.Tensor, host_pages: list[int]
) -> tuple:
    """gather_pages' staging -> its host pages, layer by layer. The staging was written
    on the stream that submitted this copy (its producer); the allocator is told this
    stream reads it too, so its memory is not reused before the transfer is done."""
    if staged.is_cuda:
        staged.record_stream(torch.cuda.current_stream(staged.device))
    return _device_to_host_runs(staged, host_kv, sorted(host_pages), range(staged.shape[0]))


def _device_to_host_runs(staged, host_kv, host_pages: list[int], layers: range) -> tuple:
    """Staging [L', n, ...] in ascending host-page order -> `host_pages` (ascending):
    each layer's runs of consecutive host pages cross in one block each (layer j of the
    staging is host layer layers[j]), all issued by one call (FOREACH_COPY)."""
    dst, src = [], []
    for i, first, n in _runs(host_pages):
        dst += host_kv[layers.start : layers.stop, first : first + n].unbind(0)
        src += staged[:, i : i + n].unbind(0)
    if dst:
        torch._foreach_copy_(dst, src, non_blocking=True)
    return (staged,)


# FOREACH_COPY: a transfer is a block a layer and run, and a Python call for each costs
# the issuing thread about 10 us, a millisecond for a swap of a 32-layer model: the blocks
# of a transfer (or of a load's group of layers) are issued by one torch._foreach_copy_
# call instead, which copies pair by pair in C++ (non-blocking, on the current stream).

# bounds a load's device staging: a group of layers larger than fits crosses in parts
LOAD_STAGING_BYTES = 256 << 20


def layer_groups(num_layers: int, max_size: int | None = None) -> list[range]:
    """The layers a load moves between two of its gates: one, one, then doubling (1, 1,
    2, 4, 8, 16 for 32 layers), none over `max_size`. The first layer waits only for its
    own pages, each later group crosses while the forward computes the layers before it,
    and a gate a group keeps the issuing to a few calls."""
    groups, start = [], 0
    while start < num_layers:
        size = max(1, start)  # 1, 1, 2, 4, ...: a group as large as all before it
        if max_size is not None:
            size = min(size, max_size)
        groups.append(range(start, min(start + size, num_layers)))
        start += size
    return groups


@dataclass
class LoadBuffers:
    """A load's device staging [G, n, C, S, H, D] and the destination pages' index,
    made on the submitting (compute) stream before the copy is submitted, so that the
    copy stream allocates nothing; the copy keeps them alive until it completes."""

    staging: torch.Tensor
    index: torch.Tensor
    groups: list[range]


def load_buffers(
    host_kv: torch.Tensor,
    dev_kv: torch.Tensor,
    host_pages: list[int],
    dev_pages: list[int],
    whole: bool = False,
    staging_bytes: int = LOAD_STAGING_BYTES,
) -> LoadBuffers:
    """The buffers host_to_device_pages needs for these pages, on the current stream.
    `whole`: staging for every layer, so no group's blocks land where another group's
    scatter has still to read (a deferred scatter: host_to_device_pages' `defer`).
    A group of layers holds at most `staging_bytes` of the pages (one layer at least)."""
    n = len(host_pages)
    _, dev_pages = _by_host_page(host_pages, dev_pages)
    layer_bytes = n * host_kv[0, 0].nbytes
    num_layers = dev_kv.shape[0]
    groups = layer_groups(num_layers, max(1, staging_bytes // max(1, layer_bytes)))
    rows = num_layers if whole else max(len(g) for g in groups)
    staging = torch.empty((rows, n, *host_kv.shape[2:]), dtype=host_kv.dtype, device=dev_kv.device)
    index = to_device(torch.tensor(dev_pages, dtype=torch.int64), dev_kv.device)
    return LoadBuffers(staging, index, groups)


def host_to_device_pages(
    host_kv: torch.Tensor,
    dev_kv: torch.Tensor,
    host_pages: list[int],
    dev_pages: list[int],
    on_layer: Callable[[int], None] | None = None,
    buffers: LoadBuffers | None = None,
    defer: Callable[[int, Callable[[], None]], None] | None = None,
    consumer: torch.cuda.Stream | None = None,
) -> tuple:
    """Host pages -> device pages, a group of layers at a time (`layer_groups`): the
    group's blocks into staging, then one scatter into the device pages, then
    `on_layer(last)` (every layer up to `last` is written), so compute on the first
    layers can start while later ones load. The groups share one staging tensor, in
    stream order (a group's blocks land after the scatter before them has read it).
    `buffers` (load_buffers, made on the submitting stream) or made here. The scatter
    is torch's index_copy_ (a Triton scatter of our own measured no better on the copy
    stream: benchmarks/HISTORY.md, twenty-first session).
    `defer` (CopyHandle.defer, with buffers made `whole`): each group's scatter and
    on_layer are handed over instead, to run later on `consumer` (CUDA: the submitting
    stream, after this stream's blocks of the group have landed; without one, as a copy
    worker issues, nothing is deferred), so no kernel runs on this stream; a deferred
    group has staging of its own."""
    if buffers is None:
        buffers = load_buffers(host_kv, dev_kv, host_pages, dev_pages, whole=defer is not None)
    staging, idx = buffers.staging, buffers.index
    if defer is not None and consumer is None and dev_kv.is_cuda:
        defer = None  # issued by a copy worker: no submitting stream to defer to
    if defer is not None and staging.shape[0] < dev_kv.shape[0]:
        raise ValueError("a deferred scatter needs staging for every layer (load_buffers whole)")
    host_pages, _ = _by_host_page(host_pages, dev_pages)
    runs = _runs(host_pages)
    # each run's blocks of every layer, one call a run: [run][layer]
    host_blocks = [host_kv[:, first : first + k].unbind(0) for _, first, k in runs]
    for group in buffers.groups:
        part = staging[: len(group)] if defer is None else staging[group.start : group.stop]
        dst, src = [], []
        for (i, _, k), blocks in zip(runs, host_blocks):
            dst += part[:, i : i + k].unbind(0)
            src += blocks[group.start : group.stop]
        if dst:  # FOREACH_COPY
            torch._foreach_copy_(dst, src, non_blocking=True)
        finish = partial(_host_to_device_scatter, dev_kv, part, idx, group, on_layer)
        if defer is None:
            finish()
        elif consumer is None:  # CPU: the blocks have landed
            defer(group.stop - 1, finish)
        else:
            defer(group.stop - 1, partial(_on_consumer, consumer, _landed(), finish))
    return (staging, idx)


def _host_to_device_scatter(dev_kv, part, idx, group: range, on_layer) -> None:
    """A group's staged pages into the pool on the current stream, then on_layer(last)."""
    raw(dev_kv).transpose(1, 2)[group.start : group.stop].index_copy_(1, idx, raw(part))
    if on_layer is not None:
        on_layer(group.stop - 1)


def _landed() -> torch.cuda.Event:
    """An event on the current (copy) stream: the blocks issued so far have landed."""
    event = torch.cuda.Event()
    event.record()
    return event


def _on_consumer(consumer: torch.cuda.Stream, landed: torch.cuda.Event, finish) -> None:
    """A deferred group's scatter, on the consumer stream after its blocks landed."""
    consumer.wait_event(landed)
    with torch.cuda.stream(consumer):
        finish()


def device_to_host_state(
    dev: tuple[torch.Tensor, torch.Tensor],
    host: tuple[torch.Tensor, torch.Tensor],
    dev_slots: list[int],
    host_slots: list[int],
    on_read: Callable[[], None] | None = None,
) -> tuple:
    """Device state slots -> host slots, (states, windows) alike, every layer: one gather
    per tensor into staging, then per layer one block per run of consecutive host slots.
    `on_read()` once the gathers are queued: past that point on the copy stream the
    device slots may be written again."""
    staged = gather_state(dev, dev_slots, host_slots)
    if on_read is not None:
        on_read()
    return _device_to_host_state_runs(staged, host, host_slots)


def gather_state(
    dev: tuple[torch.Tensor, torch.Tensor], dev_slots: list[int], host_slots: list[int]
) -> tuple:
    """The device slots of each tensor of `dev`, gathered by one kernel each on the
    current stream into new staging [L, n, ...], ordered by their host slots, and the
    index: gather_pages for state slots (`device_to_host_state_staged` takes them on)."""
    _, dev_slots = _by_host_page(host_slots, dev_slots)
    idx = to_device(torch.tensor(dev_slots, dtype=torch.int64), dev[0].device)
    return (*(t.index_select(1, idx) for t in dev), idx)


def device_to_host_state_staged(
    staged: tuple, host: tuple[torch.Tensor, torch.Tensor], host_slots: list[int]
) -> tuple:
    """gather_state's staging -> its host slots. Written on the submitting stream: the
    allocator is told this stream reads it too (device_to_host_staged)."""
    for t in staged:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
    return _device_to_host_state_runs(staged, host, host_slots)


def _device_to_host_state_runs(staged: tuple, host, host_slots: list[int]) -> tuple:
    """(states, windows, idx) staging in ascending host-slot order -> `host_slots`: per
    tensor and layer one block per run of consecutive host slots."""
    runs = _runs(sorted(host_slots))
    for src, dst in zip(staged, host):
        for layer in range(dst.shape[0]):
            for i, first, n in runs:
                dst[layer, first : first + n].copy_(src[layer, i : i + n], non_blocking=True)
    return staged


def host_to_device_state(
    host: tuple[torch.Tensor, torch.Tensor],
    dev: tuple[torch.Tensor, torch.Tensor],
    host_slots: list[int],
    dev_slots: list[int],
    defer: Callable[[int, Callable[[], None]], None] | None = None,
    consumer: torch.cuda.Stream | None = None,
) -> tuple:
    """Host state slots -> device slots, (states, windows) alike, every layer: per layer
    one block per run of consecutive host slots into staging, then one scatter per tensor.
    `defer`/`consumer` as in host_to_device_pages: the scatters are handed over (gate 0)
    to run on the submitting stream once the blocks have landed."""
    if defer is not None and consumer is None and dev[0].is_cuda:
        defer = None  # issued by a copy worker: no submitting stream to defer to
    host_slots, dev_slots = _by_host_page(host_slots, dev_slots)
    idx = to_device(torch.tensor(dev_slots, dtype=torch.int64), dev[0].device)
    runs = _runs(host_slots)
    keep, pairs = [idx], []
    for src, dst in zip(host, dev):
        staging = torch.empty(
            (dst.shape[0], len(host_slots), *dst.shape[2:]), dtype=src.dtype, device=dst.device
        )
        for layer in range(src.shape[0]):
            for i, first, n in runs:
                staging[layer, i : i + n].copy_(src[layer, first : first + n], non_blocking=True)
        pairs.append((dst, staging))
        keep.append(staging)
    finish = partial(_host_to_device_state_scatter, pairs, idx)
    if defer is None:
        finish()
    elif consumer is None:  # CPU: the blocks have landed
        defer(0, finish)
    else:
        defer(0, partial(_on_consumer, consumer, _landed(), finish))
    return tuple(keep)


def _host_to_device_state_scatter(pairs: list, idx: torch.Tensor) -> None:
    """Each tensor's staged slots into its device slots, on the current stream."""
    for dst, staging in pairs:
        dst.index_copy_(1, idx, staging)
