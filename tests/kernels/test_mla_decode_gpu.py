"""The absorbed MLA decode kernel at DeepSeek-V3 shapes on a GPU, against the float32
torch reference.

Latent rows of 512 + 64 (kv_lora_rank + qk_rope_head_dim), 16 query heads (TP 8) and 128
(TP 1), bf16, pages of 16 and 64 tokens viewed over one flat pool of ~3.8M tokens
(2.2e9 elements, so page offsets pass 2**31 elements). Page tables hold garbage ids past
each request's pages; outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_references import assert_close_relative, mla_decode_reference

from batchgen.kernels.mla_decode import choose_mla_num_splits, default_tuning, mla_decode

pytestmark = pytest.mark.gpu

LORA, ROPE = 512, 64
SCALE = (128 + ROPE) ** -0.5  # qk_nope_head_dim + qk_rope_head_dim
NUM_TOKENS = 64 * 59_400  # 3,801,600 tokens * 576 = 2.19e9 elements (4.4 GB bf16)
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def pool():
    """One flat [tokens, 576] bf16 latent pool, random; viewed as pages of any size."""
    flat = torch.empty(NUM_TOKENS, LORA + ROPE, dtype=DTYPE, device="cuda")
    flat.normal_()
    yield flat
    del flat
    torch.cuda.empty_cache()


def _latent(pool, page_size):
    return pool.view(NUM_TOKENS // page_size, page_size, 1, LORA + ROPE)


def _tables(seq_lens, page_size, gen, width=None, index_dtype=torch.int64):
    """Disjoint random pages from the whole pool per request (the first request gets the
    pool's last page), padded to one width with garbage ids."""
    num_pages = NUM_TOKENS // page_size
    need = [math.ceil(n / page_size) for n in seq_lens]
    perm = torch.randperm(num_pages - 1, generator=gen)[: sum(need)].tolist()
    perm[0] = num_pages - 1
    width = width or max(need) + 1
    garbage = [-1, 2**31 - 1, num_pages]
    rows, at = [], 0
    for n in need:
        rows.append(perm[at : at + n] + [garbage[i % 3] for i in range(width - n)])
        at += n
    return torch.tensor(rows, dtype=index_dtype, device="cuda")


def _queries(batch, heads, gen):
    q_nope = torch.randn(batch, heads, LORA, generator=gen).to("cuda", DTYPE)
    q_pe = torch.randn(batch, heads, ROPE, generator=gen).to("cuda", DTYPE)
    return q_nope, q_pe


@pytest.mark.parametrize(
    "heads,page_size,batch,lens_range,num_splits",
    [
        (16, 64, 256, (900, 1100), None),
        (16, 16, 1, (8192, 8193), None),
        (16, 16, 32, (1, 8193), 1),
        (128, 64, 1, (8000, 8193), None),
        (128, 16, 64, (1, 8193), None),
        (128, 64, 256, (1, 2049), None),
        (128, 16, 8, (6000, 8193), 64),
    ],
)
def test_mla_decode_deepseek_v3_shapes(pool, heads, page_size, batch, lens_range, num_splits):
    gen = torch.Generator().manual_seed(heads + page_size + batch)
    seq_lens = torch.randint(*lens_range, (batch,), generator=gen).tolist()
    if batch >= 4:  # a first decode, exactly one page, a page boundary plus one
        seq_lens[:3] = [1, page_size, page_size + 1]
    latent = _latent(pool, page_size)
    table = _tables(seq_lens, page_size, gen)
    lens = torch.tensor(seq_lens, device="cuda")
    q_nope, q_pe = _queries(batch, heads, gen)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode(
        q_nope,
        q_pe,
        latent,
        table,
        lens,
        SCALE,
        out=out,
        max_seq_len=max(seq_lens),
        num_splits=num_splits,
    )
    ref = mla_decode_reference(q_nope, q_pe, latent, table, lens, SCALE)
    assert_close_relative(out, ref)


def test_mla_decode_packed_rows_leave_other_rows_untouched(pool):
    gen = torch.Generator().manual_seed(7)
    seq_lens = [3000, 1, 64, 4097]
    latent = _latent(pool, 64)
    table = _tables(seq_lens, 64, gen, index_dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q_nope, q_pe = _queries(9, 128, gen)
    rows = torch.tensor([8, 0, 5, 2], device="cuda")
    out = torch.full_like(q_nope, float("nan"))
    mla_decode(q_nope, q_pe, latent, table, lens, SCALE, rows=rows, out=out, num_splits=8)
    ref = mla_decode_reference(q_nope[rows], q_pe[rows], latent, table, lens, SCALE)
    assert_close_relative(out[rows], ref)
    assert torch.isnan(out[[1, 3, 4, 6, 7]]).all(), "rows of no decode must stay untouched"


def test_mla_decode_does_not_synchronise(pool):
    gen = torch.Generator().manual_seed(8)
    latent = _latent(pool, 64)
    table = _tables([5000, 20], 64, gen)
    lens = torch.tensor([5000, 20], device="cuda")
    q_nope, q_pe = _queries(2, 16, gen)
    mla_decode(q_nope, q_pe, latent, table, lens, SCALE)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mla_decode(q_nope, q_pe, latent, table, lens, SCALE)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_relative(out, mla_decode_reference(q_nope, q_pe, latent, table, lens, SCALE))


@pytest.mark.parametrize("heads,page_size", [(16, 64), (128, 16)])
def test_mla_decode_cuda_graph_replays_with_new_seq_lens(pool, heads, page_size):
    """Captured once with static buffers, replayed with new seq lens, page tables and
    queries: each replay matches the reference and, bit for bit, an eager call with the
    same split count."""
    batch, max_len = 32, 8192
    latent = _latent(pool, page_size)
    width = max_len // page_size
    table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    q_nope = torch.zeros(batch, heads, LORA, dtype=DTYPE, device="cuda")
    q_pe = torch.zeros(batch, heads, ROPE, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q_nope)
    splits = choose_mla_num_splits(
        batch, heads, max_len, q_nope.device, default_tuning(DTYPE, q_nope.device)
    )
    assert splits > 1

    def step():
        mla_decode(q_nope, q_pe, latent, table, lens, SCALE, out=out, num_splits=splits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    gen = torch.Generator().manual_seed(heads + page_size)
    for lo, hi in [(1, 100), (4000, 8193), (1, 8193)]:
        seq_lens = torch.randint(lo, hi, (batch,), generator=gen).tolist()
        table.copy_(_tables(seq_lens, page_size, gen, width, torch.int32))
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        new_nope, new_pe = _queries(batch, heads, gen)
        q_nope.copy_(new_nope)
        q_pe.copy_(new_pe)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_relative(out, mla_decode_reference(q_nope, q_pe, latent, table, lens, SCALE))
        eager = mla_decode(q_nope, q_pe, latent, table, lens, SCALE, num_splits=splits)
        assert torch.equal(eager, out)
