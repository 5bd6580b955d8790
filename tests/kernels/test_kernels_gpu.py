"""The Triton kernels at realistic shapes on a GPU, against float32 torch references.

Qwen3-0.6B attention geometry (16 query heads, 8 KV heads, head_dim 128), bf16, pages of
16 tokens in a pool large enough that page offsets pass 2**31 elements (int64 offsets).
Outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_references import (
    assert_close_relative,
    decode_attention_reference,
    prefill_attention_reference,
    store_kv_reference,
)

from batchgen.forward_context import AttentionMetadata, PrefillSeq
from batchgen.kernels.decode_attention import choose_num_splits, decode_attention
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.store_kv import store_kv
from batchgen.layers import attention_torch, attention_triton
from benchmarks.card import page_table

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
NUM_PAGES = 140_000  # page * page stride (16 * 8 * 128) passes 2**31
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def caches():
    """K and V views of one [1, 2, P, 16, 8, 128] bf16 pool (about 9.2 GB), random."""
    pool = torch.empty(1, 2, NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    pool.normal_()
    yield pool[0, 0], pool[0, 1]
    del pool
    torch.cuda.empty_cache()


def test_store_kv_large_pool(caches):
    k_cache, v_cache = caches
    gen = torch.Generator().manual_seed(0)
    t = 4096
    qkv = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to("cuda", DTYPE)
    k, v = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]  # strided views
    pages = torch.randperm(NUM_PAGES, generator=gen)[:t].cuda()
    pages[0] = NUM_PAGES - 1  # the last page of the pool
    offs = torch.randint(0, PAGE, (t,), generator=gen).cuda()
    expected_k, expected_v = k_cache[pages].clone(), v_cache[pages].clone()
    local = torch.arange(t, device="cuda") * PAGE + offs
    store_kv_reference(expected_k, expected_v, k, v, local)
    store_kv(k_cache, v_cache, k, v, pages * PAGE + offs)
    assert torch.equal(k_cache[pages], expected_k) and torch.equal(v_cache[pages], expected_v)


def _decode_case(caches, seq_lens, gen, window=None, num_splits=None, max_seq_len=None):
    k_cache, v_cache = caches
    batch = len(seq_lens)
    table = page_table(seq_lens, NUM_PAGES, PAGE, gen)
    lens = torch.tensor(seq_lens, device="cuda")
    q = (2 * torch.randn(batch, HEADS, HEAD_DIM, generator=gen)).to("cuda", DTYPE)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        lens,
        SCALE,
        window,
        out=out,
        max_seq_len=max_seq_len or max(seq_lens),
        num_splits=num_splits,
    )
    ref = decode_attention_reference(q, k_cache, v_cache, table, lens, SCALE, window)
    assert_close_relative(out, ref)


def test_decode_batch_256_context_1000(caches):
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(900, 1100, (256,), generator=gen).tolist()
    seq_lens[0], seq_lens[1] = 1, 17  # a first decode and a partial page
    _decode_case(caches, seq_lens, gen)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_batch_32_context_16000(caches, num_splits):
    gen = torch.Generator().manual_seed(2)
    seq_lens = torch.randint(15000, 16001, (32,), generator=gen).tolist()
    seq_lens[0] = 300  # one short request among long ones: most of its splits are empty
    if num_splits is None:
        assert choose_num_splits(32, KV_HEADS, 16000, torch.device("cuda")) > 1
    _decode_case(caches, seq_lens, gen, num_splits=num_splits)


def test_decode_sliding_window(caches):
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(3000, 9000, (16,), generator=gen).tolist()
    _decode_case(caches, seq_lens, gen, window=4096, num_splits=8)


def _prefill_case(caches, specs, gen, window=None):
    """specs: (cached prefix, chunk length) per request."""
    k_cache, v_cache = caches
    seq_lens = [p + n for p, n in specs]
    q_len = [n for _, n in specs]
    q_start = [3 + sum(q_len[:i]) for i in range(len(specs))]  # rows 0-2 are decodes
    total = 3 + sum(q_len)
    table = page_table(seq_lens, NUM_PAGES, PAGE, gen)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to("cuda", DTYPE)
    args = [torch.tensor(x, device="cuda") for x in (q_start, q_len, seq_lens)]
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, *args, table, max(q_len), SCALE, window, out=out)
    ref = prefill_attention_reference(q, k_cache, v_cache, *args, table, SCALE, window)
    assert_close_relative(out[3:], ref[3:])
    assert torch.isnan(out[:3]).all(), "rows of other requests must stay untouched"


def test_prefill_chunks_of_512_after_2000_token_prefixes(caches):
    gen = torch.Generator().manual_seed(4)
    specs = [(2000, 512)] * 6 + [(0, 512), (1234, 300), (7, 2)]
    _prefill_case(caches, specs, gen)


def test_prefill_sliding_window(caches):
    gen = torch.Generator().manual_seed(5)
    _prefill_case(caches, [(2000, 512), (0, 700), (3000, 129)], gen, window=1024)


def test_backend_matches_torch_backend_on_mixed_batch(caches):
    """64 decodes and 4 prefill chunks in one packed step, as the runner lays them out."""
    k_cache, v_cache = caches
    gen = torch.Generator().manual_seed(6)
    requests = [(int(n), 1) for n in torch.randint(10, 3000, (64,), generator=gen)]
    requests[10:10] = [(2000, 512), (0, 333)]
    requests[40:40] = [(1500, 64), (16, 2)]
    seq_lens = [s + n for s, n in requests]
    table = page_table(seq_lens, NUM_PAGES, PAGE, gen)
    rows = torch.tensor([0] + [n for _, n in requests]).cumsum(0)[:-1].tolist()
    dec = [i for i, (_, n) in enumerate(requests) if n == 1]
    pre = [i for i, (_, n) in enumerate(requests) if n > 1]
    widths = [math.ceil(n / PAGE) for n in seq_lens]

    def dev(values):
        return torch.tensor(values, dtype=torch.int64, device="cuda")

    meta = AttentionMetadata(num_tokens=sum(n for _, n in requests), slot_mapping=dev([]))
    meta.decode_rows = dev([rows[i] for i in dec])
    meta.decode_page_table = table[dec][:, : max(widths[i] for i in dec)].contiguous()
    meta.decode_seq_lens = dev([seq_lens[i] for i in dec])
    meta.decode_max_seq_len = max(seq_lens[i] for i in dec)
    meta.prefill_q_start = dev([rows[i] for i in pre])
    meta.prefill_q_len = dev([requests[i][1] for i in pre])
    meta.prefill_seq_lens = dev([seq_lens[i] for i in pre])
    meta.prefill_page_table = table[pre][:, : max(widths[i] for i in pre)].contiguous()
    meta.prefill_max_q_len = max(requests[i][1] for i in pre)
    meta.prefills = [
        PrefillSeq(rows[i], requests[i][1], seq_lens[i], table[i, : widths[i]]) for i in pre
    ]
    q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=gen).to("cuda", DTYPE)
    expected = attention_torch.paged_attention(q, k_cache, v_cache, meta, SCALE)
    got = attention_triton.paged_attention(q, k_cache, v_cache, meta, SCALE)
    assert_close_relative(got, expected.float())
