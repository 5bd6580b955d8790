"""GPU regression tests for the copy-ordering contract.

Each scenario delays the compute (default) stream with a spin kernel, issues the write
the copy depends on, then the copy. With the ordering (the producer event recorded at
call time and awaited by the copy stream) the copy sees the write; with it removed
(CopyEngine(ordered=False), a test-only argument) the copy races ahead and the data is
wrong, so the unordered runs are strict xfails: if they ever pass, the test is no longer
able to see the race.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.tiered import TieredKVManager
from batchgen.layers.attention_torch import store_kv

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
SPIN = 200_000_000  # cycles the default stream spins before the producing write (~0.1 s)
ORDERING = [
    pytest.param(True, id="ordered"),
    pytest.param(
        False,
        id="unordered",
        marks=pytest.mark.xfail(
            strict=True, reason="ordering removed: the copy must race the producer"
        ),
    ),
]


def make(ordered: bool):
    device = torch.device("cuda")
    assert torch.cuda.current_stream().cuda_stream == 0, "runs on the default stream"
    pool = PagePool(LAYOUT, 64, device)
    alloc = PageAllocator(64)
    tier = TieredKVManager(
        pool, HostPool(LAYOUT, 16, pin=True), alloc, CopyEngine(device, ordered=ordered)
    )
    return tier, alloc


@pytest.mark.parametrize("ordered", ORDERING)
def test_offload_right_after_the_kernel_that_writes_its_source(ordered):
    tier, alloc = make(ordered)
    page = alloc.allocate(1)
    host = tier.host_alloc.allocate(1)
    tier.host_pool.kv[host[0]].fill_(-1)
    torch.cuda._sleep(SPIN)
    tier.device_pool.kv[:, :, page[0]].fill_(7.0)  # the producer, on the default stream
    tier.prepare_store(page, host, [None], [16], "offload")
    tier.drain()
    assert bool((tier.host_pool.kv[host[0]] == 7.0).all())


@pytest.mark.parametrize("ordered", ORDERING)
def test_decode_append_right_after_the_token_kv_write(ordered):
    tier, alloc = make(ordered)
    page = alloc.allocate(1)[0]
    host = tier.host_alloc.allocate(1)[0]
    s = LAYOUT.page_size
    layer = 2
    k = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slot = torch.tensor([page * s + 5], device="cuda")
    k_cache, v_cache = tier.device_pool.layer_caches()[layer]
    torch.cuda._sleep(SPIN)
    store_kv(k_cache, v_cache, k, v, slot)  # the token's K/V write
    tier.append_slots([page * s + 5], [host * s + 5], layer, "append")
    tier.drain()
    got = tier.host_pool.kv[host, layer, :, 5]
    assert torch.equal(got[0], k[0].cpu()) and torch.equal(got[1], v[0].cpu())


@pytest.mark.parametrize("ordered", ORDERING)
def test_load_after_the_pool_is_recreated_with_torch_zeros(ordered):
    tier, alloc = make(ordered)
    host = tier.host_alloc.allocate(1)
    tier.host_pool.kv[host[0]].fill_(5.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    tier.device_pool = PagePool(LAYOUT, 64, torch.device("cuda"))  # memset after the spin
    page = alloc.allocate(1)
    handle = tier.prepare_load(host, page, "load")
    handle.wait_on_current_stream()
    got = tier.device_pool.kv[:, :, page[0]].clone()
    tier.drain()
    assert bool((got == 5.0).all())
