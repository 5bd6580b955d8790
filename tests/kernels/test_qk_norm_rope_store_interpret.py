"""qk_norm_rope_store (one launch: q/k norm, rope, K/V write) against the two kernels it
replaces, qk_norm_rope then store_kv: the same q bits and the same page bytes, FP8 pages
included, padding rows (negative slots) writing no K/V.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets it); with
CUDA the same cases run compiled, where the two paths must agree bit for bit too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from batchgen.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_store
from batchgen.kernels.store_kv import store_kv
from batchgen.kv_quant import FP8, FP8_MAX, to_cache
from batchgen.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, KV_HEADS, HEAD_DIM, PAGES, PAGE = 4, 2, 16, 6, 4
EPS = 1e-6
SLOTS = [3, -1, 22, 5, 0, -1, 17, 9]  # two padding rows


def _tables(max_positions=64):
    rotary = RotaryEmbedding(tiny_config("Qwen3ForCausalLM"), HEAD_DIM, max_positions)
    rotary.materialize(DEVICE)
    return rotary.cos, rotary.sin


def _qkv(t, dtype, gen):
    """Rows of a wider buffer (a strided view, as a slice of a projection), with values
    past FP8's 448 and in e4m3's subnormals."""
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    x = torch.randn(t, width + 5, generator=gen) * 4.0
    x.view(-1)[3::10] *= 2**-9
    x.view(-1)[::37] = 1000.0
    x.view(-1)[1::41] = -1000.0
    return x.to(DEVICE, dtype)[:, 2 : 2 + width]


def _pool(cache_dtype, gen):
    """[layers, K/V, pages, page_size, Hkv, D] with random bytes; layer 1 is written."""
    pool = torch.randn(2, 2, PAGES, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    return to_cache(pool, FP8) if cache_dtype == FP8 else pool.to(cache_dtype)


def _both_paths(dtype, cache_dtype, with_norm, slot_dtype=torch.int64, pos_dtype=torch.int64):
    """(fused q, fused pool, two-kernel q, two-kernel pool, pool before, slots)."""
    gen = torch.Generator().manual_seed(0)
    t = len(SLOTS)
    qkv = _qkv(t, dtype, gen)
    positions = torch.randint(0, 64, (t,), generator=gen).to(DEVICE, pos_dtype)
    weights = [(1 + 0.3 * torch.randn(HEAD_DIM, generator=gen)).to(DEVICE, dtype) for _ in "qk"]
    weights = weights if with_norm else [None, None]
    slots = torch.tensor(SLOTS, dtype=slot_dtype, device=DEVICE)
    cos, sin = _tables()
    pool = _pool(cache_dtype, gen)
    before, ref_pool = pool.clone(), pool.clone()
    qkv_before = qkv.clone()
    args = (qkv, positions, cos, sin, HEADS, KV_HEADS)
    q = qk_norm_rope_store(*args, pool[1, 0], pool[1, 1], slots, *weights, EPS)
    assert torch.equal(qkv, qkv_before), "qkv must not be written"
    ref_q, ref_k = qk_norm_rope(*args, *weights, EPS)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(t, KV_HEADS, HEAD_DIM)
    store_kv(ref_pool[1, 0], ref_pool[1, 1], ref_k, v, slots)
    return q, pool, ref_q, ref_pool, before, slots


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8 else pool


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, FP8),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.float16, FP8),
        (torch.float32, FP8),
    ],
)
@pytest.mark.parametrize("with_norm", [True, False])
def test_one_launch_writes_the_two_kernels_bytes(dtype, cache_dtype, with_norm):
    q, pool, ref_q, ref_pool, before, slots = _both_paths(dtype, cache_dtype, with_norm)
    assert q.shape == (len(SLOTS), HEADS, HEAD_DIM) and q.is_contiguous()
    assert torch.equal(q, ref_q), f"{(q != ref_q).sum().item()} q elements differ"
    assert torch.equal(_bytes(pool), _bytes(ref_pool)), "the pages differ from store_kv's"
    assert torch.equal(_bytes(pool[0]), _bytes(before[0])), "layer 0 was written"
    written = slots[slots >= 0]
    for part in range(2):  # the step's slots changed, no other slot did
        now, old = (_bytes(p[1, part]).reshape(PAGES * PAGE, -1) for p in (pool, before))
        changed = (now != old).any(dim=1).nonzero().flatten()
        assert set(changed.tolist()) == set(written.tolist())
    if cache_dtype == FP8:
        assert pool[1, 1].float().abs().max().item() == FP8_MAX  # v's 1000s saturated


def test_int32_slots_and_positions_and_strided_q_out():
    q, pool, ref_q, ref_pool, _, _ = _both_paths(
        torch.bfloat16, torch.bfloat16, True, slot_dtype=torch.int32, pos_dtype=torch.int32
    )
    assert torch.equal(q, ref_q) and torch.equal(pool, ref_pool)
    gen = torch.Generator().manual_seed(1)
    t = 3
    qkv = _qkv(t, torch.bfloat16, gen)
    positions = torch.tensor([0, 5, 63], device=DEVICE)
    cos, sin = _tables()
    cache = torch.zeros(PAGES, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    buf = torch.full((t, 2 * HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    args = (qkv, positions, cos, sin, HEADS, KV_HEADS)
    got = qk_norm_rope_store(*args, cache, cache.clone(), slots, out=buf[:, ::2])
    assert got.data_ptr() == buf.data_ptr() and torch.isnan(buf[:, 1::2]).all()
    assert torch.equal(got, qk_norm_rope(*args)[0])


def test_refuses_caches_that_do_not_fit():
    gen = torch.Generator().manual_seed(2)
    qkv = _qkv(2, torch.float32, gen)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    cos, sin = _tables()
    args = (qkv, positions, cos, sin, HEADS, KV_HEADS)
    good = torch.zeros(PAGES, PAGE, KV_HEADS, HEAD_DIM, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not hold"):
        qk_norm_rope_store(*args, good[..., :8], good[..., :8], slots)
    with pytest.raises(ValueError, match="caches must be"):
        qk_norm_rope_store(*args, good, good.to(torch.bfloat16), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_store(*args, good, good, slots[:1])
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_store(*args, good, good, slots, torch.ones(HEAD_DIM, device=DEVICE))
    empty = qk_norm_rope_store(qkv[:0], positions[:0], cos, sin, HEADS, KV_HEADS, good, good,
                               slots[:0])  # fmt: skip
    assert empty.shape == (0, HEADS, HEAD_DIM) and not good.any()
