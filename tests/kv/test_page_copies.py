"""page_copies: pages cross in blocks of consecutive host pages, in host-page order, so
host ids that run backwards (a sequence evicted tail first) still move in long blocks."""

from __future__ import annotations

import torch

from batchgen.kv.page_copies import device_to_host_pages, host_to_device_pages

L, P, PH, S, H, D = 3, 8, 12, 2, 1, 4


def _pools():
    dev = torch.arange(L * 2 * P * S * H * D, dtype=torch.float32).reshape(L, 2, P, S, H, D)
    host = torch.zeros(L, PH, 2, S, H, D)
    return dev, host


def _count_host_blocks(monkeypatch) -> list:
    """Records the size (elements) of every copy whose source or destination is on host
    and lies in the host pool (the blocks that cross the bus)."""
    sizes = []
    real = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if self.dim() == 5 and src.dim() == 5:  # [n, 2, S, H, D] blocks of one layer
            sizes.append(self.shape[0])
        return real(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return sizes


def test_pages_stored_and_loaded_in_reverse_host_order_cross_in_one_block(monkeypatch):
    dev, host = _pools()
    dev_pages, host_pages = [1, 2, 3, 4], [9, 8, 7, 6]  # tail first: host ids run down
    blocks = _count_host_blocks(monkeypatch)
    device_to_host_pages(dev, host, dev_pages, host_pages)
    assert blocks == [4] * L  # one block of four pages per layer, not four of one
    for d, h in zip(dev_pages, host_pages):
        assert torch.equal(host[:, h], dev[:, :, d])
    blocks.clear()
    back = torch.zeros_like(dev)
    host_to_device_pages(host, back, host_pages, [5, 6, 7, 0])
    assert blocks == [4] * L
    for d, src in zip([5, 6, 7, 0], dev_pages):
        assert torch.equal(back[:, :, d], dev[:, :, src])
    assert back[:, :, 1:5].abs().sum() == 0  # nothing else written


def test_interleaved_host_pages_cross_in_one_block_per_run(monkeypatch):
    dev, host = _pools()
    blocks = _count_host_blocks(monkeypatch)
    host_pages, dev_pages = [3, 0, 4, 1, 10], [0, 1, 2, 3, 4]  # runs 0-1, 3-4, 10
    device_to_host_pages(dev, host, dev_pages, host_pages)
    assert sorted(blocks) == sorted([2, 2, 1] * L)
    back = torch.zeros_like(dev)
    host_to_device_pages(host, back, host_pages, [7, 6, 5, 4, 3])
    for d, src in zip([7, 6, 5, 4, 3], dev_pages):
        assert torch.equal(back[:, :, d], dev[:, :, src])
