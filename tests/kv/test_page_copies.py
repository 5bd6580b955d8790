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


def _count_host_blocks(monkeypatch, calls: list | None = None) -> list:
    """Records the size (pages) of every block copied between [n, 2, S, H, D] tensors
    (the blocks that cross the bus), issued one by one or in a list; `calls` gets the
    number of blocks each list call issued."""
    sizes = []
    real, real_all = torch.Tensor.copy_, torch._foreach_copy_

    def copy_(self, src, non_blocking=False):
        if self.dim() == 5 and src.dim() == 5:  # [n, 2, S, H, D] blocks of one layer
            sizes.append(self.shape[0])
        return real(self, src, non_blocking=non_blocking)

    def foreach_copy_(dst, src, non_blocking=False):
        if calls is not None:
            calls.append(len(dst))
        sizes.extend(d.shape[0] for d, s in zip(dst, src) if d.dim() == 5 and s.dim() == 5)
        return real_all(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch, "_foreach_copy_", foreach_copy_)
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
    blocks.clear()
    back = torch.zeros_like(dev)
    host_to_device_pages(host, back, host_pages, [7, 6, 5, 4, 3])
    for d, src in zip([7, 6, 5, 4, 3], dev_pages):
        assert torch.equal(back[:, :, d], dev[:, :, src])
    assert sorted(blocks) == sorted([2, 2, 1] * L)


def test_a_store_is_one_call_and_a_load_one_call_a_group_of_layers(monkeypatch):
    # issuing a block per layer and run from Python cost a swap of a 32-layer model on an
    # H200 a millisecond of the step's host time; the blocks go in one list call each
    layers = 32
    dev = torch.randn(layers, 2, P, S, H, D)
    host = torch.zeros(layers, PH, 2, S, H, D)
    calls: list[int] = []
    _count_host_blocks(monkeypatch, calls)
    host_pages, dev_pages = [3, 0, 4, 1, 10], [0, 1, 2, 3, 4]  # 3 runs
    device_to_host_pages(dev, host, dev_pages, host_pages)
    assert calls == [3 * layers]
    calls.clear()
    reached = []
    back = torch.zeros_like(dev)
    host_to_device_pages(host, back, host_pages, [7, 6, 5, 4, 3], reached.append)
    assert reached == [0, 1, 3, 7, 15, 31]  # the last layer of each group: 1, 1, 2, 4, 8, 16
    assert calls == [3 * n for n in (1, 1, 2, 4, 8, 16)]
    for d, src in zip([7, 6, 5, 4, 3], dev_pages):
        assert torch.equal(back[:, :, d], dev[:, :, src])
    assert back[:, :, :3].abs().sum() == 0  # nothing else written


def test_layer_groups_double_and_keep_under_the_staging_bound():
    from batchgen.kv import page_copies

    def sizes(n, cap=None):
        return [len(g) for g in page_copies.layer_groups(n, cap)]

    assert sizes(1) == [1]
    assert sizes(5) == [1, 1, 2, 1]
    assert sizes(61) == [1, 1, 2, 4, 8, 16, 29]
    assert sizes(32, 5) == [1, 1, 2, 4, 5, 5, 5, 5, 4]
    groups = page_copies.layer_groups(61, 7)
    assert [layer for g in groups for layer in g] == list(range(61))
    # a load larger than the staging bound crosses in more groups, all of it still
    layers = 8
    dev = torch.randn(layers, 2, P, S, H, D)
    host = torch.zeros(layers, PH, 2, S, H, D)
    device_to_host_pages(dev, host, list(range(P)), list(range(P)))
    one_layer = P * host[0, 0].nbytes
    reached, back, pages = [], torch.zeros_like(dev), list(range(P))
    buffers = page_copies.load_buffers(host, back, pages, pages, staging_bytes=2 * one_layer)
    keep = host_to_device_pages(host, back, pages, pages, reached.append, buffers)
    assert reached == [0, 1, 3, 5, 7]  # groups 1, 1, 2, 2, 2
    assert keep[0].shape[0] == 2  # staging of two layers, shared by the groups
    assert torch.equal(back, dev)


def test_a_gate_marked_for_a_group_reaches_the_layers_before_it():
    from batchgen.kv.copy_engine import CopyHandle

    handle = CopyHandle("load", 0, cuda=False, num_gates=6)
    handle.mark(0)
    handle.mark(3)
    assert all(g.event.is_set() for g in handle.gates[:4])
    assert not handle.gates[4].event.is_set() and not handle.gates[5].event.is_set()
    assert handle.gates[1] is handle.gates[3] and handle.gates[0] is not handle.gates[3]
    handle.mark(5)
    assert all(g.event.is_set() for g in handle.gates)


def test_load_with_buffers_made_before():
    """host_to_device_pages with its buffers made first (as the tier makes them on the
    compute stream) loads the same pages as one that makes its own."""
    from batchgen.kv.page_copies import load_buffers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers, comps, tail = 4, 2, (4, 2, 8)
    host = torch.randn(layers, 9, comps, *tail).to(torch.bfloat16)
    if device.type == "cuda":
        host = host.pin_memory()
    host_pages, dev_pages = [8, 2, 3, 4], [6, 0, 1, 5]
    gen = torch.Generator().manual_seed(3)
    got = torch.randn(layers, comps, 7, *tail, generator=gen).to(device, torch.bfloat16)
    want = got.clone()
    host_to_device_pages(host, want, host_pages, dev_pages)  # buffers made inside
    buffers = load_buffers(host, got, host_pages, dev_pages)
    reached = []
    kept = host_to_device_pages(host, got, host_pages, dev_pages, reached.append, buffers=buffers)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert kept[0] is buffers.staging
    assert reached == [g.stop - 1 for g in buffers.groups]
    assert torch.equal(got, want)
    for h, d in zip(host_pages, dev_pages):
        assert torch.equal(got[:, :, d].cpu(), host[:, h])
