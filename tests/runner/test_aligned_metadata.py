"""Per-step metadata crosses to the device in one packed copy whose parts each start
16-byte aligned: Triton specialises a pointer argument on that alignment, so a part that
starts aligned in one step and unaligned in the next (an odd count of requests before
it) compiles the kernel anew in the middle of a run. On the H200 this cost W4 a 0.6 to
1 s step: its third prefill step was the first with 17 prefill requests, and the MLA
prefill index packed its parts end to end.

Each builder is run at odd counts and its views are checked for their offsets in the
packed tensor and for their values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.forward_context import (
    AttentionMetadata,
    LinearAttentionMetadata,
    LinearSeq,
    PrefillSeq,
    pack_aligned,
    unpack_aligned,
)


def _offsets_aligned(base: torch.Tensor, views: list[torch.Tensor]) -> list[int]:
    """Byte offsets of the views in base that are not multiples of 16."""
    offsets = [v.data_ptr() - base.data_ptr() for v in views]
    return [o for o in offsets if o % 16]


@pytest.mark.parametrize("sizes", [[1, 1, 1], [3, 5, 7, 2], [0, 1, 17, 4], [17, 17, 17, 34]])
def test_pack_aligned_round_trip_with_aligned_parts(sizes):
    rng = np.random.default_rng(sum(sizes))
    parts = [rng.integers(-9, 9, size=n) for n in sizes]
    packed = torch.from_numpy(pack_aligned(parts))
    views = unpack_aligned(packed, sizes)
    assert _offsets_aligned(packed, views) == []
    for view, part in zip(views, parts):
        assert view.tolist() == part.tolist()
    assert packed.numel() == sum(n + n % 2 for n in sizes)


def test_pack_aligned_takes_tables_and_lists():
    table = np.arange(15).reshape(5, 3)
    packed = torch.from_numpy(pack_aligned([[7], table, (1, 2, 3)]))
    one, flat, last = unpack_aligned(packed, [1, table.size, 3])
    assert one.tolist() == [7] and last.tolist() == [1, 2, 3]
    assert flat.view(5, 3).tolist() == table.tolist()
    assert _offsets_aligned(packed, [one, flat, last]) == []


@pytest.mark.parametrize("num", [1, 2, 17])
def test_mla_prefill_index_parts_are_aligned(num):
    from batchgen.layers.mla_triton import _prefill_index

    page = 4
    meta = AttentionMetadata(num_tokens=0, slot_mapping=torch.zeros(0, dtype=torch.int64))
    q_start, seqs = 0, []
    for i in range(num):
        q_len, seq_len = 3 + i % 4, 5 + 2 * i
        pages = torch.arange(100 * i, 100 * i + -(-seq_len // page))
        seqs.append(PrefillSeq(q_start, q_len, seq_len, pages))
        q_start += q_len
    meta.prefills = seqs
    pages, (starts, lens, seq_lens, table), max_q_len = _prefill_index(meta, torch.device("cpu"))
    base = starts  # the first part sits at the packed tensor's start
    assert _offsets_aligned(base, [starts, lens, seq_lens, table]) == []
    assert starts.tolist() == [s.q_start for s in seqs]
    assert lens.tolist() == [s.q_len for s in seqs]
    assert seq_lens.tolist() == [s.seq_len for s in seqs]
    assert max_q_len == max(s.q_len for s in seqs)
    for i, s in enumerate(seqs):  # request i's rows of the table index its own pages
        n = s.pages.numel()
        assert pages[table[i, :n]].tolist() == s.pages.tolist()


@pytest.mark.parametrize("num", [1, 3, 17])
def test_linear_metadata_parts_are_aligned(num):
    seqs, row = [], 0
    for i in range(num):
        seqs.append(LinearSeq(row, 1 + i % 3, slot=10 + i, has_state=bool(i % 2)))
        row += 1 + i % 3
    meta = LinearAttentionMetadata.build(seqs, "cpu")
    views = [meta.cu_seqlens, meta.state_slots, meta.fresh_slots]
    assert _offsets_aligned(meta.cu_seqlens, views) == []
    assert meta.cu_seqlens.tolist() == [s.q_start for s in seqs] + [row]
    assert meta.state_slots.tolist() == [s.slot for s in seqs]
    assert meta.fresh_slots.tolist() == [s.slot for s in seqs if not s.has_state]


@pytest.mark.parametrize("decodes,prefills", [(1, 1), (3, 2), (17, 5)])
def test_kda_split_parts_are_aligned(decodes, prefills):
    from batchgen.layers.kda_ops import _split

    seqs, row = [], 0
    for i in range(decodes + prefills):
        q_len = 1 if i < decodes else 4 + i
        seqs.append(LinearSeq(row, q_len, slot=50 + i, has_state=True))
        row += q_len
    seqs = seqs[::2] + seqs[1::2]  # decode and prefill rows interleaved in the batch
    seqs = sorted(seqs, key=lambda s: s.slot % 3)
    row = 0
    for s in seqs:
        s.q_start, row = row, row + s.q_len
    split = _split(LinearAttentionMetadata.build(seqs, "cpu"), torch.device("cpu"))
    dec = [s for s in seqs if s.q_len == 1]
    pre = [s for s in seqs if s.q_len > 1]
    rows = [s.q_start for s in dec], [r for s in pre for r in range(s.q_start, s.q_start + s.q_len)]
    if isinstance(split.decode_rows, slice):  # each kind in one block: views, no index
        parts = [p for p in split[:-1] if not isinstance(p, slice)]
        assert (decodes, prefills) == (1, 1)  # one of each can only be two blocks
        assert list(range(row)[split.decode_rows]) == rows[0]
        assert list(range(row)[split.prefill_rows]) == rows[1]
    else:
        parts = list(split)[:-1]
        assert split.decode_rows.tolist() == rows[0]
        assert split.prefill_rows.tolist() == rows[1]
    assert _offsets_aligned(parts[0], parts) == []
    assert split.decode_slots.tolist() == [s.slot for s in dec]
    assert split.prefill_slots.tolist() == [s.slot for s in pre]
    cu = np.concatenate([[0], np.cumsum([s.q_len for s in pre])]).tolist()
    assert split.prefill_cu.tolist() == cu and split.prefill_cu_host.tolist() == cu


@pytest.mark.parametrize(
    "max_len,page_size,pages", [(2064, 16, 144), (2048, 16, 128), (1, 16, 16), (520, 4, 144)]
)
def test_page_table_rows_hold_a_multiple_of_16_pages(max_len, page_size, pages):
    from batchgen.runner.inputs import table_pages
    from batchgen.runner.page_rows import PageRows

    assert table_pages(max_len, page_size) == pages
    # rows sized by anyone else (the memory plan's warm-up runner) are rounded up too
    rows = PageRows(3, -(-max_len // page_size))
    assert rows.table.shape == (3, pages) and rows.max_pages == pages


def test_decode_graphs_and_eager_steps_share_the_page_tables_row_stride(tiny_llama):
    """Triton specialises an int argument on its divisibility by 16, the page table's row
    stride too. A graph's kernels read its static table's full rows, an eager step's the
    step's table cut to a multiple of 16 pages: with rows of 33 pages (520 tokens) the
    graphs' decode variants, compiled at capture, were not the ones a mixed step's eager
    decode launched, which compiled its own mid-run. Both hold 48 now, every step's width
    a multiple of 16 up to the rows' own."""
    from batchgen import LLM
    from batchgen.engine.decode_graphs import build_decode_graphs
    from batchgen.runner.inputs import table_width

    llm = LLM(model=tiny_llama, device="cpu", dtype="float32", max_model_len=520)
    eng = llm.engine
    rows = eng.runner.batch.page_rows.table
    assert rows.shape[1] == 48  # 33 pages of 16 tokens, rounded up
    graphs = build_decode_graphs(
        eng.config, None, [], "triton", None, 8, torch.device("cpu"), torch.float32, 520
    )
    assert graphs.table.stride(0) == rows.shape[1]
    widths = {table_width(-(-n // 16), rows.shape[1]) for n in range(1, 521)}
    assert widths == {16, 32, 48}
    eng.shutdown()


@pytest.mark.parametrize("num", [1, 3, 6, 17])
@pytest.mark.parametrize("penalised", [False, True])
def test_sampling_metadata_crosses_in_one_copy_with_aligned_parts(num, penalised):
    """`SamplingState.to_device`: the float columns (as bytes), seeds, positions, top_k
    and the kept penalty rows in one int64 tensor (one copy to a GPU), every part and
    every float row 16-byte aligned, each holding the step's values."""
    from batchgen.runner.penalty_counts import PenaltyCounts
    from batchgen.runner.sampler import SamplingState
    from batchgen.sampling_params import SamplingParams

    cpu = torch.device("cpu")
    state = SamplingState(50, cpu, [2], penalty_counts=PenaltyCounts(50, cpu))
    params = [
        SamplingParams(
            temperature=0.5 + i / 10,
            top_p=0.9,
            top_k=3 + i,
            min_p=0.01 * i,
            presence_penalty=0.25 if penalised and i % 2 else 0.0,
        )
        for i in range(num)
    ]
    ids = [f"r{i}" for i in range(num)]
    outputs = [[4] * i for i in range(num)]  # positions 0..num-1, as the kept counts' steps
    meta = state.build(ids, params, [[1, 2]] * num, outputs, list(range(num)), range(9, 9 + num))
    views = [meta.temperature, meta.top_p, meta.top_k, meta.min_p, meta.seeds, meta.positions]
    if penalised and num > 1:  # row 0 has no penalty
        views += [meta.presence_penalty, meta.frequency_penalty, meta.repetition_penalty]
        views += [meta.penalty_source[2], *meta.penalty_rows[:2]]
    assert _offsets_aligned(meta.temperature, views) == []
    storage = meta.temperature.untyped_storage().data_ptr()  # one tensor crossed
    assert all(v.untyped_storage().data_ptr() == storage for v in views)
    assert meta.top_k.dtype == torch.int64 and meta.top_k.tolist() == [3 + i for i in range(num)]
    assert meta.temperature.tolist() == pytest.approx([0.5 + i / 10 for i in range(num)])
    assert meta.min_p.tolist() == pytest.approx([0.01 * i for i in range(num)])
    assert meta.seeds.tolist() == list(range(9, 9 + num))
    assert meta.positions.tolist() == list(range(num))
    assert (meta.presence_penalty is not None) == (penalised and num > 1)
