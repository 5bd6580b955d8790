"""The absorbed MLA decode kernel against its torch reference, and the reference against
attention over the decompressed per-head keys and values, on tiny random inputs.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_references import mla_decode_reference

from batchgen.kernels.mla_decode import (
    choose_mla_num_splits,
    default_tuning,
    head_blocks,
    mla_decode,
)
from batchgen.runner.cuda_graphs import DecodeSplitPlan, bucket_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LORA, ROPE = 32, 16
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _latent(num_pages, page_size, dtype, gen, padded_rows=False):
    """Layer 1's latent view [P, S, 1, LORA + ROPE] of a two-layer pool; with padded_rows
    the pool's rows are wider than the latent (strides that are not the shape's)."""
    width = LORA + ROPE + (8 if padded_rows else 0)
    pool = torch.randn(2, num_pages, page_size, 1, width, generator=gen)
    return pool.to(DEVICE, dtype)[1, ..., : LORA + ROPE]


def _page_table(seq_lens, page_size, num_pages, gen, index_dtype=torch.int64):
    """Disjoint random pages per request; the unused tail of each row holds garbage ids
    (negative and far past the pool) that the kernel must never follow."""
    need = [math.ceil(n / page_size) for n in seq_lens]
    perm = torch.randperm(num_pages, generator=gen).tolist()
    width = max(need) + 2
    garbage = [-1, 2**31 - 1, num_pages + 7]
    rows, at = [], 0
    for n in need:
        rows.append(perm[at : at + n] + [garbage[i % 3] for i in range(width - n)])
        at += n
    return torch.tensor(rows, dtype=index_dtype, device=DEVICE)


def _queries(batch, heads, dtype, gen):
    q_nope = torch.randn(batch, heads, LORA, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(batch, heads, ROPE, generator=gen).to(DEVICE, dtype)
    return q_nope, q_pe


def _assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "non-finite outputs (rows left unwritten?)"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype,page_size,heads,num_splits,index_dtype,padded_rows",
    [
        (torch.float32, 4, 4, 1, torch.int64, False),
        (torch.float32, 16, 4, 3, torch.int32, True),
        (torch.float32, 32, 20, 2, torch.int64, False),  # two head blocks, a partial one
        (torch.bfloat16, 4, 4, 2, torch.int32, False),
        (torch.bfloat16, 8, 20, 4, torch.int64, True),
        (torch.float16, 16, 4, 2, torch.int32, False),
    ],
)
def test_mla_decode_matches_reference(
    dtype, page_size, heads, num_splits, index_dtype, padded_rows
):
    gen = torch.Generator().manual_seed(0)
    # a first decode, exactly one page, a page boundary plus one, ragged
    seq_lens = [1, page_size, 2 * page_size + 1, 37]
    num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 3
    latent = _latent(num_pages, page_size, dtype, gen, padded_rows)
    table = _page_table(seq_lens, page_size, num_pages, gen, index_dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype, device=DEVICE)
    q_nope, q_pe = _queries(len(seq_lens), heads, dtype, gen)
    out = torch.full_like(q_nope, float("nan"))
    got = mla_decode(q_nope, q_pe, latent, table, lens, 0.15, out=out, num_splits=num_splits)
    assert got is out
    ref = mla_decode_reference(q_nope, q_pe, latent, table, lens, 0.15)
    _assert_close(out, ref, dtype)


def test_mla_decode_packed_rows_and_flat_latent():
    """Queries at rows of a packed batch, latent given as [P, S, D]: the other rows of
    out stay untouched."""
    gen = torch.Generator().manual_seed(1)
    page_size, seq_lens = 8, [19, 1, 8]
    latent = _latent(12, page_size, torch.float32, gen)[:, :, 0]
    table = _page_table(seq_lens, page_size, 12, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q_nope, q_pe = _queries(6, 4, torch.float32, gen)
    rows = torch.tensor([4, 0, 3], device=DEVICE)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode(q_nope, q_pe, latent, table, lens, 0.2, rows=rows, out=out, num_splits=2)
    ref = mla_decode_reference(q_nope[rows], q_pe[rows], latent, table, lens, 0.2)
    _assert_close(out[rows], ref, torch.float32)
    assert torch.isnan(out[[1, 2, 5]]).all(), "rows of no decode must stay untouched"


def test_split_counts_agree_and_empty_sequences_give_zeros():
    """1 to 8 splits (most of them empty for the short requests) give one answer; a
    padding row with seq_len 0 gives zeros, whatever its page table holds."""
    gen = torch.Generator().manual_seed(2)
    page_size, seq_lens = 4, [0, 3, 70, 16]
    latent = _latent(40, page_size, torch.float32, gen)
    table = _page_table([max(n, 1) for n in seq_lens], page_size, 40, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q_nope, q_pe = _queries(4, 4, torch.float32, gen)
    ref = mla_decode_reference(q_nope, q_pe, latent, table, lens, 0.3)
    assert torch.equal(ref[0], torch.zeros_like(ref[0]))
    for num_splits in (1, 2, 5, 8):
        out = mla_decode(q_nope, q_pe, latent, table, lens, 0.3, num_splits=num_splits)
        _assert_close(out, ref, torch.float32)
        assert torch.equal(out[0], torch.zeros_like(out[0])), num_splits


def _decompressed_attention(q_heads, w_uk, w_uv, c_kv, k_pe, scale):
    """Standard MHA from scratch for one request: per-head keys [k_nope | k_pe] and values
    expanded from the latent. q_heads [H, dn + R], w_uk [H, dn, C], w_uv [H, dv, C],
    c_kv [N, C], k_pe [N, R] -> [H, dv]."""
    dn = w_uk.shape[1]
    out = []
    for h in range(q_heads.shape[0]):
        k = torch.cat([c_kv @ w_uk[h].T, k_pe], dim=1)  # [N, dn + R]
        v = c_kv @ w_uv[h].T  # [N, dv]
        probs = torch.softmax((k @ q_heads[h]) * scale, dim=0)
        out.append(probs @ v)
    assert q_heads.shape[1] == dn + k_pe.shape[1]
    return torch.stack(out)


def test_absorbed_attention_matches_decompressed_attention():
    """Folding W_UK into the query and applying W_UV after the latent attention is
    standard attention over the decompressed keys and values: the reference and the
    kernel both agree with the from-scratch computation."""
    gen = torch.Generator().manual_seed(3)
    heads, nope_dim, v_dim, page_size = 4, 24, 20, 4
    seq_lens = [1, 4, 23]
    scale = (nope_dim + ROPE) ** -0.5
    latent = _latent(12, page_size, torch.float32, gen)
    table = _page_table(seq_lens, page_size, 12, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    w_uk = (torch.randn(heads, nope_dim, LORA, generator=gen) / LORA**0.5).to(DEVICE)
    w_uv = (torch.randn(heads, v_dim, LORA, generator=gen) / LORA**0.5).to(DEVICE)
    q_heads = (2 * torch.randn(len(seq_lens), heads, nope_dim + ROPE, generator=gen)).to(DEVICE)
    q_pe = q_heads[..., nope_dim:]
    q_nope = torch.einsum("bhn,hnc->bhc", q_heads[..., :nope_dim], w_uk)  # absorbed
    ref = mla_decode_reference(q_nope, q_pe, latent, table, lens, scale)
    got = mla_decode(q_nope, q_pe.contiguous(), latent, table, lens, scale, num_splits=2)
    for b, seq_len in enumerate(seq_lens):
        pages = table[b, : math.ceil(seq_len / page_size)]
        tokens = latent[pages].flatten(0, 2)[:seq_len]
        c_kv, k_pe = tokens[:, :LORA], tokens[:, LORA:]
        expected = _decompressed_attention(q_heads[b], w_uk, w_uv, c_kv, k_pe, scale)
        for latent_out in (ref[b], got[b]):
            torch.testing.assert_close(
                torch.einsum("hc,hvc->hv", latent_out, w_uv), expected, atol=1e-4, rtol=1e-4
            )


def test_split_count_comes_from_host_ints_and_matches_the_graph_plan():
    tuning = default_tuning(torch.bfloat16, DEVICE)
    for batch in (1, 3, 64, 256):
        for heads in (4, 16, 128):
            n = choose_mla_num_splits(batch, heads, 8192, DEVICE, tuning)
            assert n >= 1 and n & (n - 1) == 0
    plan = DecodeSplitPlan(256, head_blocks(128, tuning), 8192, DEVICE)
    for n in (1, 5, 100, 256):
        bs = bucket_for(n, 256)
        assert plan(n) == choose_mla_num_splits(bs, 128, 8192, DEVICE, tuning)
    gen = torch.Generator().manual_seed(4)
    latent = _latent(80, 4, torch.float32, gen)
    table = _page_table([300, 5], 4, 80, gen)
    lens = torch.tensor([300, 5], device=DEVICE)
    q_nope, q_pe = _queries(2, 4, torch.float32, gen)
    out = mla_decode(q_nope, q_pe, latent, table, lens, 0.2, max_seq_len=300)
    _assert_close(out, mla_decode_reference(q_nope, q_pe, latent, table, lens, 0.2), torch.float32)


def test_rejects_inputs_that_do_not_fit():
    gen = torch.Generator().manual_seed(5)
    latent = _latent(4, 4, torch.float32, gen)
    table = _page_table([3], 4, 4, gen)
    lens = torch.tensor([3], device=DEVICE)
    q_nope, q_pe = _queries(1, 4, torch.float32, gen)
    bad = [
        dict(q_pe=q_pe[..., :8]),  # C + R != the latent's width
        dict(q_pe=q_pe.to(torch.bfloat16)),
        dict(latent=latent.expand(4, 4, 2, LORA + ROPE)),  # more than one head
        dict(page_table=table.float()),
        dict(out=torch.empty(1, 4, LORA + 1, device=DEVICE)),
        dict(num_splits=0),
    ]
    args = dict(q_nope=q_nope, q_pe=q_pe, latent=latent, page_table=table, seq_lens=lens)
    for change in bad:
        kwargs = {**args, **change}
        with pytest.raises(ValueError):
            mla_decode(softmax_scale=0.2, **kwargs)
