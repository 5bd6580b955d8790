"""FP8 KV pages (kv_cache_dtype "fp8", batchgen/kv_quant.py) in the Triton kernels: the
store kernel quantizes as the torch path does (saturating at 448), and the decode,
prefill and MLA decode kernels read float8_e4m3fn caches, matching their references over
the same caches upcast to float32.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets it); with
CUDA the same cases run compiled. The values span e4m3's subnormals (below 2^-6), its
normal range and beyond 448 (saturated)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_references import (
    decode_attention_reference,
    mla_decode_reference,
    prefill_attention_reference,
)
from test_kernels_interpret import _metadata, _page_tables

from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.mla_decode import mla_decode
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.store_kv import store_kv, store_latent
from batchgen.kv_quant import FP8, FP8_MAX, to_cache
from batchgen.layers import attention_torch, attention_triton, mla_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM = 16
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _values(shape, gen, scale=4.0, saturate=True):
    """Random values, a tenth of them scaled into e4m3's subnormals (below 2^-6), and a
    few beyond FP8_MAX where `saturate`."""
    x = torch.randn(shape, generator=gen) * scale
    x.view(-1)[3::10] *= 2**-9
    if saturate:
        flat = x.view(-1)
        step = max(flat.numel() // 5, 1)
        flat[::step] = 1000.0  # saturates at FP8_MAX
        flat[1::step] = -1000.0
    return x.to(DEVICE)


def _fp8_caches(num_pages, page_size, num_kv_heads, gen):
    """Layer 1's K and V views of a [L, 2, P, S, Hkv, D] FP8 pool."""
    shape = (2, 2, num_pages, page_size, num_kv_heads, HEAD_DIM)
    pool = to_cache(torch.randn(shape, generator=gen).to(DEVICE), FP8)
    return pool[1, 0], pool[1, 1]


def test_fp8_cast_saturates_and_rounds():
    x = torch.tensor([1000.0, -600.0, 448.0, 3.3, -0.3])
    got = to_cache(x, FP8).float()
    assert got.tolist() == [FP8_MAX, -FP8_MAX, 448.0, 3.25, -0.3125]


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_into_fp8_matches_the_torch_path(src_dtype):
    gen = torch.Generator().manual_seed(0)
    num_pages, page_size, heads = 6, 4, 2
    shape = (2, 2, num_pages, page_size, heads, HEAD_DIM)
    pool = torch.zeros(shape, dtype=FP8, device=DEVICE)
    ref_pool = pool.clone()
    k = _values((7, heads, HEAD_DIM), gen).to(src_dtype)
    v = _values((7, heads, HEAD_DIM), gen, scale=0.5).to(src_dtype)
    slots = torch.tensor([3, 22, 5, 0, 17, 9, 11], device=DEVICE)
    store_kv(pool[1, 0], pool[1, 1], k, v, slots)
    attention_torch.store_kv(ref_pool[1, 0], ref_pool[1, 1], k, v, slots)
    assert torch.equal(pool.view(torch.uint8), ref_pool.view(torch.uint8))
    stored = pool[1, 0].view(-1, heads, HEAD_DIM)[slots].float()
    assert stored.abs().max().item() == FP8_MAX  # the 1000s saturated, not NaN
    assert (stored - k.float().clamp(-FP8_MAX, FP8_MAX)).abs().max() <= FP8_MAX / 16
    assert not pool[0].float().any(), "layer 0 was written"


def test_store_latent_into_fp8_skips_padding_and_matches_the_torch_path():
    gen = torch.Generator().manual_seed(1)
    width = 48
    cache = torch.zeros(5, 4, 1, width, dtype=FP8, device=DEVICE)
    ref = cache.clone()
    latent = _values((4, width), gen)
    slots = torch.tensor([2, -1, 13, 7], device=DEVICE)
    store_latent(cache, latent, slots)
    keep = slots >= 0
    mla_torch.store_latent(ref, latent[keep], slots[keep])
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("q_dtype,num_splits", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_decode_attention_reads_fp8_caches(q_dtype, num_splits):
    gen = torch.Generator().manual_seed(2)
    page_size, heads, group = 4, 2, 2
    seq_lens = [1, 37, 22]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 2
    k_cache, v_cache = _fp8_caches(num_pages, page_size, heads, gen)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q = torch.randn(3, heads * group, HEAD_DIM, generator=gen).to(DEVICE, q_dtype)
    out = decode_attention(q, k_cache, v_cache, table, lens, 0.3, num_splits=num_splits)
    ref = decode_attention_reference(q, k_cache.float(), v_cache.float(), table, lens, 0.3)
    torch.testing.assert_close(out.float(), ref, atol=TOL[q_dtype], rtol=TOL[q_dtype])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_fp8_caches(q_dtype):
    gen = torch.Generator().manual_seed(3)
    page_size, heads, group = 4, 2, 2
    specs = [(0, 13), (9, 6)]
    seq_lens = [p + n for p, n in specs]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 2
    k_cache, v_cache = _fp8_caches(num_pages, page_size, heads, gen)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    q_len = [n for _, n in specs]
    q_start = [0, q_len[0]]
    q = torch.randn(sum(q_len), heads * group, HEAD_DIM, generator=gen).to(DEVICE, q_dtype)
    args = [torch.tensor(x, device=DEVICE) for x in (q_start, q_len, seq_lens)]
    out = prefill_attention(q, k_cache, v_cache, *args, table, max(q_len), 0.3)
    ref = prefill_attention_reference(q, k_cache.float(), v_cache.float(), *args, table, 0.3)
    torch.testing.assert_close(out.float(), ref, atol=TOL[q_dtype], rtol=TOL[q_dtype])


@pytest.mark.parametrize("q_dtype,num_splits", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_mla_decode_reads_an_fp8_latent(q_dtype, num_splits):
    gen = torch.Generator().manual_seed(4)
    lora, rope, page_size, heads = 32, 16, 4, 4
    seq_lens = [5, 30]
    num_pages = 12
    latent = to_cache(torch.randn(num_pages, page_size, 1, lora + rope, generator=gen), FP8)
    latent = latent.to(DEVICE)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q_nope = torch.randn(2, heads, lora, generator=gen).to(DEVICE, q_dtype)
    q_pe = torch.randn(2, heads, rope, generator=gen).to(DEVICE, q_dtype)
    out = mla_decode(q_nope, q_pe, latent, table, lens, 0.2, num_splits=num_splits)
    ref = mla_decode_reference(q_nope, q_pe, latent.float(), table, lens, 0.2)
    torch.testing.assert_close(out.float(), ref, atol=TOL[q_dtype], rtol=TOL[q_dtype])


def test_kernels_refuse_caches_of_another_float_dtype():
    k_cache = torch.zeros(4, 4, 1, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    q = torch.zeros(1, 1, HEAD_DIM, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="must both be q's dtype or FP8"):
        decode_attention(q, k_cache, k_cache, table, lens, 1.0)


def test_triton_backend_matches_torch_backend_on_fp8_pages():
    """One mixed step (decodes, a chunk after a cached prefix, a fresh prompt) written
    and attended by each backend over FP8 pages: the same bytes, the same outputs; and
    the outputs within FP8's rounding of the same step over float32 pages."""
    gen = torch.Generator().manual_seed(5)
    page_size, heads, group = 4, 2, 2
    requests = [(40, 1), (13, 19), (6, 1), (0, 11)]
    seq_lens = [s + n for s, n in requests]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 2
    tables, _ = _page_tables(seq_lens, page_size, num_pages, gen)
    meta = _metadata(requests, page_size, tables)
    f32_k = _values((num_pages, page_size, heads, HEAD_DIM), gen, 1.0, saturate=False)
    f32_v = f32_k.flip(0).clone()
    t = meta.num_tokens
    q = torch.randn(t, heads * group, HEAD_DIM, generator=gen).to(DEVICE)
    k = _values((t, heads, HEAD_DIM), gen, 1.0, saturate=False)
    v = k.flip(0).clone()
    torch_k, torch_v = to_cache(f32_k, FP8), to_cache(f32_v, FP8)  # earlier steps' K/V
    tri_k, tri_v = torch_k.clone(), torch_v.clone()

    attention_torch.store_kv(torch_k, torch_v, k, v, meta.slot_mapping)
    expected = attention_torch.paged_attention(q, torch_k, torch_v, meta, 0.3)
    attention_triton.store_kv(tri_k, tri_v, k, v, meta.slot_mapping)
    assert torch.equal(tri_k.view(torch.uint8), torch_k.view(torch.uint8))
    assert torch.equal(tri_v.view(torch.uint8), torch_v.view(torch.uint8))
    got = attention_triton.paged_attention(q, tri_k, tri_v, meta, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    attention_torch.store_kv(f32_k, f32_v, k, v, meta.slot_mapping)
    exact = attention_torch.paged_attention(q, f32_k, f32_v, meta, 0.3)
    err = (got - exact).abs().max().item()
    assert err < 0.05 * exact.abs().max().item(), err
