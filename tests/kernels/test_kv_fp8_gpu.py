"""FP8 KV pages on a GPU at realistic shapes: the store kernel writes the bytes torch's
cast does, and the decode, prefill and MLA decode kernels over float8_e4m3fn caches match
float32 references over the same caches upcast (bf16 queries, as users run).

Qwen3-0.6B's attention geometry (16 query heads, 8 KV heads, head_dim 128) and
DeepSeek-V3's latent (512 + 64, 16 and 128 heads), pages of 16 and 64 tokens."""

from __future__ import annotations

import pytest
import torch
from kernel_references import (
    assert_close_relative,
    decode_attention_reference,
    mla_decode_reference,
    prefill_attention_reference,
)

from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.mla_decode import mla_decode
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.store_kv import store_kv, store_latent
from batchgen.kv_quant import FP8, to_cache
from benchmarks.card import page_table

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
NUM_PAGES = 20_000
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def caches():
    pool = to_cache(torch.randn(2, NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, device="cuda"), FP8)
    yield pool[0], pool[1]
    del pool
    torch.cuda.empty_cache()


def test_store_kv_writes_torch_cast_bytes():
    gen = torch.Generator().manual_seed(0)
    t = 4096
    k = (torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen) * 50).to("cuda", DTYPE)
    v = (torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen) * 0.01).to("cuda", DTYPE)
    k_cache = torch.zeros(t // PAGE + 1, PAGE, KV_HEADS, HEAD_DIM, dtype=FP8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * PAGE, generator=gen)[:t].cuda()
    store_kv(k_cache, v_cache, k, v, slots)
    want_k = to_cache(k, FP8).view(torch.uint8)
    want_v = to_cache(v, FP8).view(torch.uint8)
    assert torch.equal(k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].view(torch.uint8), want_k)
    assert torch.equal(v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].view(torch.uint8), want_v)
    latent = (torch.randn(t, 576, generator=gen) * 3).to("cuda", DTYPE)
    cache = torch.zeros(t // 64 + 1, 64, 1, 576, dtype=FP8, device="cuda")
    slots = torch.randperm(cache.shape[0] * 64, generator=gen)[:t].cuda()
    store_latent(cache, latent, slots)
    got = cache.view(-1, 576)[slots].view(torch.uint8)
    assert torch.equal(got, to_cache(latent, FP8).view(torch.uint8))


@pytest.mark.parametrize("batch,lens,num_splits", [(256, (900, 1100), None), (8, (6000, 8000), 1)])
def test_decode_over_fp8_pages(caches, batch, lens, num_splits):
    k_cache, v_cache = caches
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(*lens, (batch,), generator=gen).tolist()
    table = page_table(seq_lens, NUM_PAGES, PAGE, gen)
    seqs = torch.tensor(seq_lens, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to("cuda", DTYPE)
    out = decode_attention(
        q, k_cache, v_cache, table, seqs, HEAD_DIM**-0.5, num_splits=num_splits,
        max_seq_len=max(seq_lens),
    )  # fmt: skip
    ref = decode_attention_reference(
        q, k_cache.float(), v_cache.float(), table, seqs, HEAD_DIM**-0.5
    )
    assert_close_relative(out, ref)


def test_prefill_over_fp8_pages(caches):
    k_cache, v_cache = caches
    gen = torch.Generator().manual_seed(2)
    specs = [(0, 700), (2000, 512), (37, 1)]
    seq_lens = [p + n for p, n in specs]
    table = page_table(seq_lens, NUM_PAGES, PAGE, gen)
    q_len = [n for _, n in specs]
    q_start = [sum(q_len[:i]) for i in range(len(specs))]
    q = torch.randn(sum(q_len), HEADS, HEAD_DIM, generator=gen).to("cuda", DTYPE)
    args = [torch.tensor(x, device="cuda") for x in (q_start, q_len, seq_lens)]
    out = prefill_attention(q, k_cache, v_cache, *args, table, max(q_len), HEAD_DIM**-0.5)
    ref = prefill_attention_reference(
        q, k_cache.float(), v_cache.float(), *args, table, HEAD_DIM**-0.5
    )
    assert_close_relative(out, ref)


@pytest.mark.parametrize("heads,page_size,batch", [(16, 64, 128), (128, 16, 16)])
def test_mla_decode_over_an_fp8_latent(heads, page_size, batch):
    gen = torch.Generator().manual_seed(3)
    num_pages = 4096 * 64 // page_size
    latent = to_cache(torch.randn(num_pages, page_size, 1, 576, device="cuda"), FP8)
    seq_lens = torch.randint(1, 2049, (batch,), generator=gen).tolist()
    table = page_table(seq_lens, num_pages, page_size, gen)
    seqs = torch.tensor(seq_lens, device="cuda")
    q_nope = torch.randn(batch, heads, 512, generator=gen).to("cuda", DTYPE)
    q_pe = torch.randn(batch, heads, 64, generator=gen).to("cuda", DTYPE)
    out = mla_decode(q_nope, q_pe, latent, table, seqs, 192**-0.5)
    ref = mla_decode_reference(q_nope, q_pe, latent.float(), table, seqs, 192**-0.5)
    assert_close_relative(out, ref)
