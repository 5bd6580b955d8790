"""mla_rope_store (MLA's rope with the latent rows written straight into the pages)
against the two launches it replaces, mla_rope_latent then store_latent: the same q bits
and the same page bytes, FP8 pages included, padding rows (negative slots) writing none.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it); with
CUDA the same cases run compiled, where the two paths must agree bit for bit too.
"""

from __future__ import annotations

import pytest
import torch
from test_mla_rope_interpret import DEVICE, EPS, NOPE, RANK, ROPE, _inputs, _rotary

from batchgen.kernels.mla_rope import mla_rope_latent, mla_rope_store
from batchgen.kernels.store_kv import store_latent
from batchgen.kv_quant import FP8, FP8_MAX, to_cache

PAGES, PAGE = 4, 4
SLOTS = [3, -1, 14, 0, -1, 9]  # two padding rows


def _pool(dtype, gen):
    """[layers, pages, page_size, 1, C + R] of random rows; layer 1 is written."""
    pool = torch.randn(2, PAGES, PAGE, 1, RANK + ROPE, generator=gen).to(DEVICE)
    return to_cache(pool, FP8) if dtype == FP8 else pool.to(dtype)


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8 else pool


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, FP8),
        (torch.float32, torch.float32),
        (torch.float32, FP8),
    ],
)
@pytest.mark.parametrize("interleaved", [True, False])
def test_one_launch_writes_the_two_launches_bytes(dtype, cache_dtype, interleaved):
    rotary = _rotary()
    _, q, kv, weight, positions = _inputs(len(SLOTS), dtype)
    weight = weight * 300  # the latent's c_kv part past FP8's 448
    slots = torch.tensor(SLOTS, device=DEVICE)
    pool = _pool(cache_dtype, torch.Generator().manual_seed(1))
    ref_pool, before, ref_q = pool.clone(), pool.clone(), q.clone()
    args = (positions, rotary.cos, rotary.sin, weight, EPS, NOPE, interleaved)
    latent = mla_rope_latent(ref_q, kv, *args)
    store_latent(ref_pool[1], latent, slots)
    assert mla_rope_store(q, kv, *args, pool[1], slots) is None
    assert torch.equal(q, ref_q), f"{(q != ref_q).sum().item()} q elements differ"
    assert torch.equal(_bytes(pool), _bytes(ref_pool)), "the pages differ from store_latent's"
    assert torch.equal(_bytes(pool[0]), _bytes(before[0])), "layer 0 was written"
    now, old = (_bytes(p[1]).reshape(PAGES * PAGE, -1) for p in (pool, before))
    changed = (now != old).any(dim=1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(s for s in SLOTS if s >= 0)
    if cache_dtype == FP8:
        assert pool[1].float().abs().max().item() == FP8_MAX  # saturated, not NaN


def test_three_dimensional_pages_and_bad_caches():
    rotary = _rotary()
    _, q, kv, weight, positions = _inputs(len(SLOTS), torch.bfloat16, seed=2)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    args = (positions, rotary.cos, rotary.sin, weight, EPS, NOPE, True)
    pages = torch.zeros(PAGES, PAGE, RANK + ROPE, dtype=torch.bfloat16, device=DEVICE)
    ref_q = q.clone()
    latent = mla_rope_latent(ref_q, kv, *args)
    mla_rope_store(q, kv, *args, pages, slots)
    kept = slots >= 0
    assert torch.equal(pages.view(-1, RANK + ROPE)[slots[kept].long()], latent[kept])
    assert torch.equal(q, ref_q)
    with pytest.raises(ValueError, match="does not hold"):
        mla_rope_store(q, kv, *args, pages[..., 1:], slots)
    with pytest.raises(ValueError, match="FP8 or"):
        mla_rope_store(q, kv, *args, pages.float(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_rope_store(q, kv, *args, pages, slots[1:])
