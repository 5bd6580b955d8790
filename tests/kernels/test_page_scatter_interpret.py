"""The load scatter kernel (kernels/page_scatter.py) against torch's index_copy_ on the
same pool view: staged pages land in their device pages, layer group offset kept, every
other page and layer untouched. Without CUDA the kernel runs in Triton's interpreter;
with CUDA the same cases run compiled on the GPU, and a host tier load through it
matches one through index_copy_."""

from __future__ import annotations

import pytest
import torch
from kernel_references import page_scatter_reference

from batchgen.kernels.page_scatter import page_scatter
from batchgen.kv.page_copies import host_to_device_pages, load_buffers

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pool(layers, comps, pages, tail, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, comps, pages, *tail, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize(
    "comps,tail,dtype,first",
    [
        (2, (4, 2, 8), torch.float32, 0),  # K and V, a page of 64 elements
        (2, (16, 8, 128), torch.bfloat16, 1),  # an 8B page (16,384 elements: 4 blocks)
        (1, (4, 1, 36), torch.float16, 2),  # an MLA latent, elements not a power of two
    ],
)
def test_scatter_matches_index_copy(comps, tail, dtype, first):
    layers, pages, n = 5, 11, 4
    pool = _pool(layers, comps, pages, tail, dtype, seed=1)
    staging = _pool(2, n, comps, tail, dtype, seed=2)  # [G, n, C, ...]
    index = torch.tensor([7, 0, 9, 3], device=DEVICE)
    want = pool.clone()
    page_scatter_reference(want, staging, index, first)
    page_scatter(pool, staging, index, first)
    assert torch.equal(pool, want)
    # the reference moved what it should, so equality is not two untouched pools
    assert torch.equal(pool[first + 1, :, 9], staging[1, 2])
    assert not torch.equal(pool[first], _pool(layers, comps, pages, tail, dtype, 1)[first])


def test_scatter_rejects_what_does_not_fit():
    pool = _pool(3, 2, 5, (4, 1, 8), torch.float32, 0)
    staging = _pool(2, 2, 2, (4, 1, 8), torch.float32, 1)
    index = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="layers"):
        page_scatter(pool, staging, index, first_layer=2)
    with pytest.raises(ValueError, match="index"):
        page_scatter(pool, staging, index.float(), 0)
    with pytest.raises(ValueError, match="does not fit"):
        page_scatter(pool, staging[:, :, :1], index, 0)


@pytest.mark.parametrize("scatter", ["index", "triton"])
def test_load_with_buffers_made_before(scatter):
    """host_to_device_pages with its buffers made first (as the tier makes them on the
    compute stream) loads the same pages as one that makes its own."""
    layers, comps, tail = 4, 2, (4, 2, 8)
    host = torch.randn(layers, 9, comps, *tail).to(torch.bfloat16)
    if DEVICE.type == "cuda":
        host = host.pin_memory()
    host_pages, dev_pages = [8, 2, 3, 4], [6, 0, 1, 5]
    got = _pool(layers, comps, 7, tail, torch.bfloat16, 3)
    want = got.clone()
    host_to_device_pages(host, want, host_pages, dev_pages)  # buffers made inside
    buffers = load_buffers(host, got, host_pages, dev_pages)
    reached = []
    kept = host_to_device_pages(
        host, got, host_pages, dev_pages, reached.append, buffers=buffers, scatter=scatter
    )
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert kept[0] is buffers.staging
    assert reached == [g.stop - 1 for g in buffers.groups]
    assert torch.equal(got, want)
    for h, d in zip(host_pages, dev_pages):
        assert torch.equal(got[:, :, d].cpu(), host[:, h])


def test_load_rejects_an_unknown_scatter():
    host, dev = torch.zeros(2, 3, 2, 4, 1, 2), torch.zeros(2, 2, 3, 4, 1, 2)
    with pytest.raises(ValueError, match="scatter"):
        host_to_device_pages(host, dev, [0], [1], scatter="sort")
