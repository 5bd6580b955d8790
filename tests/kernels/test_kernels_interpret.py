"""Each Triton kernel against its torch reference on small random inputs.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets it);
with CUDA the same small cases run compiled on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_references import (
    decode_attention_reference,
    prefill_attention_reference,
    store_kv_reference,
    store_latent_reference,
)

from batchgen.forward_context import AttentionMetadata, PrefillSeq
from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.store_kv import store_kv, store_latent
from batchgen.layers import attention_torch, attention_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM = 16
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _caches(num_pages, page_size, num_kv_heads, dtype, layers=2):
    """Layer 1's K and V views of a [L, 2, P, S, Hkv, D] pool, as the page pool hands out."""
    shape = (layers, 2, num_pages, page_size, num_kv_heads, HEAD_DIM)
    pool = torch.randn(shape, device=DEVICE).to(dtype)
    return pool[1, 0], pool[1, 1]


def _page_tables(seq_lens, page_size, num_pages, gen):
    """Disjoint random pages per request, padded with page 0 to one width."""
    need = [math.ceil(n / page_size) for n in seq_lens]
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    width = max(need)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return tables, torch.tensor(padded, dtype=torch.int64, device=DEVICE)


def _assert_close(out, ref, dtype):
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_store_kv_matches_reference(src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = _caches(12, 4, 2, cache_dtype)
    qkv = torch.randn(10, 3, 2, HEAD_DIM, device=DEVICE).to(src_dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as after a fused qkv projection
    slots = torch.randperm(48, generator=gen)[:10].to(DEVICE)
    slots[3] = -1  # a padding row writes nothing
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(ref_k, ref_v, k, v, slots)
    store_kv(k_cache, v_cache, k, v, slots)
    # the interpreter rounds float32 -> bfloat16 toward zero (the GPU to nearest even)
    rtol = 2**-7 if src_dtype != cache_dtype and DEVICE.type == "cpu" else 0
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=rtol)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_latent_matches_reference(dtype):
    """MLA's one-component cache: layer 1 of a [L, P, S, 1, W] pool, W not a power of two."""
    gen = torch.Generator().manual_seed(1)
    width = 40
    cache = torch.randn(2, 12, 4, 1, width, device=DEVICE).to(dtype)[1]
    latent = torch.randn(9, width + 8, device=DEVICE).to(dtype)[:, :width]  # strided rows
    slots = torch.randperm(48, generator=gen)[:9].to(DEVICE)
    slots[[2, 8]] = -1  # padding rows of a graph batch write nothing
    ref = cache.clone()
    store_latent_reference(ref, latent, slots)
    store_latent(cache, latent, slots)
    torch.testing.assert_close(cache, ref, atol=0, rtol=0)


@pytest.mark.parametrize(
    "dtype,group,page_size,window,num_splits",
    [
        (torch.float32, 1, 4, None, 1),
        (torch.float32, 2, 16, None, 3),
        (torch.bfloat16, 4, 4, None, 2),
        (torch.float32, 2, 4, 9, 2),
        (torch.bfloat16, 2, 16, 20, 1),
    ],
)
def test_decode_attention_matches_reference(dtype, group, page_size, window, num_splits):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads = 2
    seq_lens = [1, 37, 70, 16]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 3
    k_cache, v_cache = _caches(num_pages, page_size, num_kv_heads, dtype)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    # packed batch of 7 rows; the decodes are rows 5, 0, 3, 6
    q = torch.randn(7, num_kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    rows = torch.tensor([5, 0, 3, 6], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, k_cache, v_cache, table, lens, 0.3, window, rows=rows, out=out, num_splits=num_splits
    )
    ref = decode_attention_reference(q[rows], k_cache, v_cache, table, lens, 0.3, window)
    _assert_close(out[rows], ref, dtype)
    assert torch.isnan(out[[1, 2, 4]]).all(), "rows of no decode must stay untouched"


def test_decode_attention_without_rows_picks_splits():
    gen = torch.Generator().manual_seed(2)
    seq_lens = [300, 5]
    k_cache, v_cache = _caches(90, 8, 1, torch.float32)
    _, table = _page_tables(seq_lens, 8, 90, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q = torch.randn(2, 3, HEAD_DIM, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, table, lens, 0.25, max_seq_len=300)
    ref = decode_attention_reference(q, k_cache, v_cache, table, lens, 0.25)
    _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize(
    "dtype,group,page_size,window",
    [
        (torch.float32, 1, 4, None),
        (torch.float32, 2, 16, None),
        (torch.bfloat16, 2, 4, None),
        (torch.float32, 2, 4, 7),
        (torch.bfloat16, 4, 16, 24),
    ],
)
def test_prefill_attention_matches_reference(dtype, group, page_size, window):
    gen = torch.Generator().manual_seed(3)
    num_kv_heads = 2
    # (prefix, q_len): a fresh prompt, a chunk after a cached prefix, a short tail
    specs = [(0, 21), (30, 18), (9, 2)]
    seq_lens = [p + n for p, n in specs]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 2
    k_cache, v_cache = _caches(num_pages, page_size, num_kv_heads, dtype)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    q_len = [n for _, n in specs]
    q_start = [1 + sum(q_len[:i]) for i in range(len(specs))]  # row 0 is someone else's
    total = 1 + sum(q_len) + 1
    q = torch.randn(total, num_kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    args = [torch.tensor(x, device=DEVICE) for x in (q_start, q_len, seq_lens)]
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, *args, table, max(q_len), 0.3, window, out=out)
    ref = prefill_attention_reference(q, k_cache, v_cache, *args, table, 0.3, window)
    rows = slice(1, total - 1)
    _assert_close(out[rows], ref[rows], dtype)
    assert torch.isnan(out[0]).all() and torch.isnan(out[-1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_takes_narrower_values(dtype):
    """MLA's decompressed heads: keys 40 wide (nope + rope), values 24; out is 24 wide."""
    gen = torch.Generator().manual_seed(5)
    page_size, heads, dk, dv = 4, 3, 40, 24
    specs = [(0, 13), (10, 6)]
    seq_lens = [p + n for p, n in specs]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 1
    k_cache = torch.randn(num_pages, page_size, heads, dk, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_pages, page_size, heads, dv, device=DEVICE).to(dtype)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    q_len = [n for _, n in specs]
    q_start = [0, q_len[0]]
    q = torch.randn(sum(q_len), heads, dk, device=DEVICE).to(dtype)
    args = [torch.tensor(x, device=DEVICE) for x in (q_start, q_len, seq_lens)]
    ref = prefill_attention_reference(q, k_cache, v_cache, *args, table, 0.2)
    # twice: Triton 3.6's 8-warp bf16 program for these widths faulted from its second
    # launch in a process on (compute-sanitizer), the first being clean
    for _ in range(2):
        out = prefill_attention(q, k_cache, v_cache, *args, table, max(q_len), 0.2)
        assert out.shape == (sum(q_len), heads, dv)
        _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_heads", [1, 3])
def test_prefill_attention_with_keys_in_two_parts(dtype, rope_heads):
    """MLA's split keys: q and keys 32 wide as strided views of wider rows, q_rope and
    k_rope 16 wide, k_rope one head shared by all (MLA's k_pe) or one per head; against
    the reference on the joined tensors, and against the kernel on them."""
    gen = torch.Generator().manual_seed(6)
    page_size, heads, dn, dr, dv = 4, 3, 32, 16, 24
    specs = [(0, 13), (10, 6)]
    seq_lens = [p + n for p, n in specs]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 1
    kv = torch.randn(num_pages, page_size, heads, dn + dv, device=DEVICE).to(dtype)
    k_cache, v_cache = kv[..., :dn], kv[..., dn:]  # views, as the decompressed latent gives
    latent = torch.randn(num_pages, page_size, 1, 40 + dr, device=DEVICE).to(dtype)
    k_rope = latent[..., 40:].expand(-1, -1, rope_heads, -1)
    if rope_heads > 1:
        k_rope = torch.randn(num_pages, page_size, rope_heads, dr, device=DEVICE).to(dtype)
    _, table = _page_tables(seq_lens, page_size, num_pages, gen)
    q_len = [n for _, n in specs]
    q_start = [0, q_len[0]]
    q_full = torch.randn(sum(q_len), heads, dn + dr, device=DEVICE).to(dtype)
    q, q_rope = q_full[..., :dn], q_full[..., dn:].contiguous()
    args = [torch.tensor(x, device=DEVICE) for x in (q_start, q_len, seq_lens)]
    out = prefill_attention(
        q, k_cache, v_cache, *args, table, max(q_len), 0.2, q_rope=q_rope, k_rope=k_rope
    )
    ref = prefill_attention_reference(
        q, k_cache, v_cache, *args, table, 0.2, q_rope=q_rope, k_rope=k_rope
    )
    _assert_close(out, ref, dtype)
    joined_k = torch.cat((k_cache, k_rope.expand(-1, -1, heads, -1)), dim=-1)
    joined = prefill_attention(q_full, joined_k, v_cache, *args, table, max(q_len), 0.2)
    _assert_close(out, joined.float(), dtype)


def test_prefill_attention_rejects_half_a_rope_pair():
    q = torch.zeros(2, 2, 16, device=DEVICE)
    cache = torch.zeros(3, 4, 2, 16, device=DEVICE)
    args = [torch.tensor(x, device=DEVICE) for x in ([0], [2], [2])]
    table = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="both q_rope and k_rope"):
        prefill_attention(q, cache, cache, *args, table, 2, 1.0, q_rope=q[..., :8])
    with pytest.raises(ValueError, match="k_rope"):
        prefill_attention(
            q, cache, cache, *args, table, 2, 1.0, q_rope=q[..., :8], k_rope=cache[:, :, :1, :4]
        )


def _metadata(requests, page_size, tables):
    """AttentionMetadata as the ModelRunner builds it. requests: (start, n) per request."""
    slots, decode, prefill, row = [], [], [], 0
    for (start, n), table in zip(requests, tables):
        seq_len = start + n
        slots += [table[p // page_size] * page_size + p % page_size for p in range(start, seq_len)]
        (decode if n == 1 else prefill).append((row, n, seq_len, table))
        row += n

    def dev(values):
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    def padded(tabs):
        width = max(len(t) for t in tabs)
        return dev([t + [0] * (width - len(t)) for t in tabs])

    meta = AttentionMetadata(num_tokens=row, slot_mapping=dev(slots))
    meta.decode_rows = dev([d[0] for d in decode])
    meta.decode_page_table = padded([d[3] for d in decode])
    meta.decode_seq_lens = dev([d[2] for d in decode])
    meta.decode_max_seq_len = max(d[2] for d in decode)
    meta.prefill_q_start = dev([p[0] for p in prefill])
    meta.prefill_q_len = dev([p[1] for p in prefill])
    meta.prefill_seq_lens = dev([p[2] for p in prefill])
    meta.prefill_page_table = padded([p[3] for p in prefill])
    meta.prefill_max_q_len = max(p[1] for p in prefill)
    meta.prefills = [PrefillSeq(p[0], p[1], p[2], dev(p[3])) for p in prefill]
    return meta


@pytest.mark.parametrize("window", [None, 6])
def test_triton_backend_matches_torch_backend_on_mixed_batch(window):
    gen = torch.Generator().manual_seed(4)
    page_size, num_kv_heads, group = 4, 2, 2
    # (tokens already cached, new tokens): decode, prefix + chunk, decode, fresh prompt
    requests = [(40, 1), (13, 19), (6, 1), (0, 11)]
    seq_lens = [s + n for s, n in requests]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 2
    tables, _ = _page_tables(seq_lens, page_size, num_pages, gen)
    meta = _metadata(requests, page_size, tables)
    k_cache, v_cache = _caches(num_pages, page_size, num_kv_heads, torch.float32)
    torch_k, torch_v = k_cache.clone(), v_cache.clone()
    t = meta.num_tokens
    q = torch.randn(t, num_kv_heads * group, HEAD_DIM, device=DEVICE)
    k = torch.randn(t, num_kv_heads, HEAD_DIM, device=DEVICE)
    v = torch.randn(t, num_kv_heads, HEAD_DIM, device=DEVICE)

    attention_torch.store_kv(torch_k, torch_v, k, v, meta.slot_mapping)
    expected = attention_torch.paged_attention(q, torch_k, torch_v, meta, 0.3, window)
    attention_triton.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    assert torch.equal(k_cache, torch_k) and torch.equal(v_cache, torch_v)
    got = attention_triton.paged_attention(q, k_cache, v_cache, meta, 0.3, window)
    _assert_close(got, expected.float(), torch.float32)

    # the same step when the runner left the padded prefill tensors out
    meta.prefill_q_start = meta.prefill_q_len = None
    meta.prefill_seq_lens = meta.prefill_page_table = None
    got = attention_triton.paged_attention(q, k_cache, v_cache, meta, 0.3, window)
    _assert_close(got, expected.float(), torch.float32)
