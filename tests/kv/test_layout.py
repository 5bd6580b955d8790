"""KVLayout for both cache kinds: MHA (K and V) and MLA (one latent). The pool, the host
pool and the tier's copies take either through the same code."""

from __future__ import annotations

import pytest
import torch

from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.tiered import TieredKVManager
from batchgen.kv_state import KVState

MHA = KVLayout.of(KVState.mha(num_kv_heads=2, head_dim=8), 3, page_size=4, dtype=torch.float32)
MLA = KVLayout.of(KVState.latent(16 + 8), 3, page_size=4, dtype=torch.bfloat16)


def test_state_kinds():
    assert KVState.mha(4, 64) == KVState(2, 4, 64)
    assert KVState.latent(576) == KVState(1, 1, 576)
    with pytest.raises(ValueError, match="positive"):
        KVState(0, 1, 8)


def test_bytes_per_page_counts_components():
    assert MHA.bytes_per_page == 3 * 2 * 4 * 2 * 8 * 4
    assert MLA.bytes_per_page == 3 * 1 * 4 * 1 * 24 * 2
    # DeepSeek-V3: 61 layers of a 576-wide latent, bf16, 64-token pages
    ds = KVLayout.of(KVState.latent(512 + 64), 61, 64, torch.bfloat16)
    assert ds.bytes_per_page == 61 * 64 * 576 * 2


@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
def test_pools_and_layer_caches(layout):
    pool = PagePool(layout, 5, torch.device("cpu"))
    assert pool.nbytes == 5 * layout.bytes_per_page
    caches = pool.layer_caches()
    assert len(caches) == layout.num_layers
    for i, layer in enumerate(caches):
        assert len(layer) == layout.num_components
        for c, cache in enumerate(layer):
            assert cache.shape == (5, layout.page_size, layout.num_kv_heads, layout.head_dim)
            cache.fill_(10 * i + c)  # a view: writes land in the pool
    assert pool.kv[2, layout.num_components - 1].eq(20 + layout.num_components - 1).all()
    host = HostPool.sized(layout, 7 * layout.bytes_per_page / 2**30, pin=False)
    assert host.num_pages == 7 and host.nbytes == 7 * layout.bytes_per_page
    assert host.page(0).shape == pool.kv[:, :, 0].shape


@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
def test_tier_stores_and_loads_pages_of_either_layout(layout):
    pool = PagePool(layout, 6, torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape))
    alloc = PageAllocator(6)
    host = HostPool(layout, 4, pin=False)
    tier = TieredKVManager(pool, host, alloc, CopyEngine(torch.device("cpu")), debug=True)
    src = alloc.allocate(2)
    want = [pool.kv[:, :, p].clone() for p in src]
    tier.queue_store(src, [b"a", b"b"], "write_through", "r")
    tier.flush()
    tier.drain()  # debug reads every stored page back and compares it
    alloc.free(src)
    hosts = tier.lookup([b"a", b"b"])
    dst = alloc.allocate(2)
    pool.kv[:, :, dst] = 0
    tier.queue_load(hosts, dst, "prefix_load", "r")
    (handle,) = tier.flush()
    for layer in range(layout.num_layers):
        handle.wait_layer(layer)
    tier.drain()
    for p, w in zip(dst, want):
        assert torch.equal(pool.kv[:, :, p], w)
