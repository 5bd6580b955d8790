"""The copy bodies the CopyEngine runs on a copy stream. Each returns what it must keep
alive until its completion event fires (rule 5)."""

from __future__ import annotations

import torch


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


def device_to_host_pages(
    dev_kv: torch.Tensor, host_kv: torch.Tensor, dev_pages: list[int], host_pages: list[int]
) -> tuple:
    """dev_kv [L, 2, P, S, H, D] pages -> host_kv [Ph, L, 2, S, H, D] pages."""
    idx = torch.tensor(dev_pages, dtype=torch.int64).to(dev_kv.device, non_blocking=True)
    staged = dev_kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
    for i, first, n in _runs(host_pages):
        host_kv[first : first + n].copy_(staged[i : i + n], non_blocking=True)
    return (staged, idx)


def host_to_device_pages(
    host_kv: torch.Tensor, dev_kv: torch.Tensor, host_pages: list[int], dev_pages: list[int]
) -> tuple:
    """host_kv pages -> dev_kv pages."""
    staged = torch.empty(
        (len(host_pages), *host_kv.shape[1:]), dtype=host_kv.dtype, device=dev_kv.device
    )
    for i, first, n in _runs(host_pages):
        staged[i : i + n].copy_(host_kv[first : first + n], non_blocking=True)
    idx = torch.tensor(dev_pages, dtype=torch.int64).to(dev_kv.device, non_blocking=True)
    dev_kv.index_copy_(2, idx, staged.permute(1, 2, 0, 3, 4, 5))
    return (staged, idx)


def device_to_host_slots(
    dev_kv: torch.Tensor, dev_slots: list[int], layer: int | None, pinned: torch.Tensor
) -> tuple:
    """Gather token slots (page * page_size + offset) of one layer (or all) into a pinned
    staging tensor [n, L', 2, H, D]; the host pool is filled from it on completion."""
    lay = dev_kv if layer is None else dev_kv[layer : layer + 1]
    flat = lay.flatten(2, 3)  # [L', 2, P*S, H, D]
    idx = torch.tensor(dev_slots, dtype=torch.int64).to(dev_kv.device, non_blocking=True)
    staged = flat.index_select(2, idx).permute(2, 0, 1, 3, 4).contiguous()
    pinned.copy_(staged, non_blocking=True)
    return (staged, idx, pinned)
