"""batchgen_debug's readback: a finished store of pages or of a state slot checked
against its device source, raising `KVReadbackError` on a difference. The copy ledger
(kv/copy_ledger.py) runs it after each store it submits, on rank 0 and on the workers."""

from __future__ import annotations

import torch

from batchgen.kv.copy_engine import CopyHandle
from batchgen.kv.host_pool import HostPool
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool, StatePool


class KVReadbackError(RuntimeError):
    """batchgen_debug found an offloaded page that differs from its device source."""


def readback_pages(
    handle: CopyHandle,
    device_pool: PagePool,
    host_pool: HostPool,
    dev_pages: list[int],
    host_pages: list[int],
    tags: list,
    layers: range,
    metrics,
) -> None:
    """batchgen_debug: wait for a store, then compare each host page with its device
    source over `layers` (nothing has written the source since the copy was issued: debug
    runs no step ahead), counting each in `metrics.readback_checks`; KVReadbackError on a
    difference."""
    handle.synchronize()
    first, end = layers.start, layers.stop
    for dev, host, tag in zip(dev_pages, host_pages, tags):
        src = device_pool.kv[first:end, :, dev].cpu()
        dst = host_pool.kv[first:end, host]
        metrics.readback_checks += 1
        check_offloaded(src, dst, tag, dev, host, first)


def readback_slot(
    handle: CopyHandle,
    device_pool: StatePool,
    host_pool: HostStatePool,
    dev_slot: int,
    host_slot: int,
    tag,
    metrics,
) -> None:
    """batchgen_debug: wait for a state store, then compare the host slot with its device
    source (states and conv windows), counted as one check; KVReadbackError on a
    difference."""
    handle.synchronize()
    metrics.readback_checks += 1
    src = (device_pool.states[:, dev_slot].cpu(), device_pool.windows[:, dev_slot].cpu())
    dst = (host_pool.states[:, host_slot], host_pool.windows[:, host_slot])
    check_offloaded_state(src, dst, dev_slot, host_slot, tag)


def check_offloaded(src: torch.Tensor, dst: torch.Tensor, tag, dev, host, first_layer) -> None:
    """KVReadbackError unless host copy `dst` of device page `dev` equals `src` (both on
    the host, [layers, ...]) and is finite."""
    if not torch.isfinite(dst.float()).all():
        raise KVReadbackError(f"{tag}: non-finite KV in offloaded device page {dev}")
    if not torch.equal(src, dst):
        bad = (src != dst).flatten(1).any(-1).nonzero()[0, 0].item()
        raise KVReadbackError(
            f"{tag}: layer {first_layer + bad} of device page {dev} differs from its host "
            f"copy (host page {host})"
        )


def check_offloaded_state(src: tuple, dst: tuple, dev_slot: int, host_slot: int, tag) -> None:
    """KVReadbackError unless host slot `host_slot`'s (state, conv window) `dst` equals
    device slot `dev_slot`'s `src` (both on the host, [KDA layers, ...]) and is finite."""
    for what, src_one, dst_one in zip(("state", "conv window"), src, dst):
        if not torch.isfinite(dst_one.float()).all():
            raise KVReadbackError(f"{tag}: non-finite {what} in offloaded state slot {dev_slot}")
        if not torch.equal(src_one, dst_one):
            bad = (src_one != dst_one).flatten(1).any(-1).nonzero()[0, 0].item()
            raise KVReadbackError(
                f"{tag}: KDA layer {bad}'s {what} of device state slot {dev_slot} differs "
                f"from its host copy (host slot {host_slot})"
            )
