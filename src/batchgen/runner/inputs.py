"""A step's packed inputs, built with numpy from the persistent page rows and sent to the
device in one copy: input ids, positions, KV slots, the rows to sample from, and the
decode and prefill attention metadata."""

from __future__ import annotations

import numpy as np
import torch

from batchgen.forward_context import AttentionMetadata, PrefillSeq, pack_aligned, unpack_aligned
from batchgen.runner.input_batch import (
    StepRow,
    StepRows,
    decode_columns,
    request_ids,
    token_columns,
)
from batchgen.runner.page_rows import aligned_pages
from batchgen.runner.staging import HostStaging


def table_pages(max_len: int, page_size: int) -> int:
    """The pages a page-table row holds (the runner's table and the decode graphs'
    static one): enough for max_len tokens, rounded up to a multiple of TABLE_ALIGN. A
    step's table is cut to a multiple of it (`table_width`), and a graph's kernels read
    the full row's stride: a row of, say, 129 pages (W1's max_model_len of 2064) gave the
    decode kernel a second specialisation, so the variants the graphs' capture compiled
    (one a split count) were not the ones a mixed step's eager decode launches, and each
    of those compiled at its first mixed step, in the middle of a run."""
    return aligned_pages(-(-max(max_len, 1) // page_size))


def table_width(pages: int, max_pages: int) -> int:
    """Page-table width for a step: a multiple of 16 (so the kernels' row stride keeps
    one Triton specialisation, the decode graphs' too where max_pages is `table_pages`),
    at most the table's."""
    return min(aligned_pages(pages), max_pages)


def pack_step(
    reqs: list[StepRow],
    table: np.ndarray,
    page_size: int,
    stage: HostStaging,
    split_plan=None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Packed input ids, positions, attention metadata and the rows to sample from.
    Each part crosses to the device in one copy, 16-byte aligned (Triton specialises
    pointers on it)."""
    ps = page_size
    max_pages = table.shape[1]
    num = len(reqs)
    lens, ids = token_columns(reqs)  # kept by StepRows: pipelined_ids read them first
    rows, starts, sample = decode_columns(reqs)  # a StepRows' columns: no StepRow a row
    ends = np.cumsum(lens)
    q_start = ends - lens
    total = int(ends[-1])
    owner = np.repeat(np.arange(num), lens)
    positions = np.arange(total, dtype=np.int64) - q_start[owner] + starts[owner]
    slots = table[rows[owner], positions // ps] * ps + positions % ps
    seq_lens = starts + lens
    parts = [ids, positions, slots, ends[sample] - 1]
    decode, prefill = np.flatnonzero(lens == 1), np.flatnonzero(lens > 1)
    dec_width = pre_width = 0
    if decode.size:
        dec_width = table_width(-(-int(seq_lens[decode].max()) // ps), max_pages)
        parts += [q_start[decode], seq_lens[decode], table[rows[decode], :dec_width]]
    if prefill.size:
        pre_width = table_width(-(-int(seq_lens[prefill].max()) // ps), max_pages)
        pre_table = table[rows[prefill], :pre_width]
        parts += [q_start[prefill], lens[prefill], seq_lens[prefill], pre_table]
    sizes = [p.size for p in parts]
    dev = stage(pack_aligned(parts))
    views = iter(unpack_aligned(dev, sizes))
    input_ids, pos_dev, slots_dev, sample_rows = (next(views) for _ in range(4))
    meta = AttentionMetadata(num_tokens=total, slot_mapping=slots_dev)
    if decode.size:
        meta.decode_rows = next(views)
        meta.decode_seq_lens = next(views)
        meta.decode_page_table = next(views).view(decode.size, dec_width)
        meta.decode_max_seq_len = int(seq_lens[decode].max())
        if split_plan is not None:
            meta.decode_num_splits = split_plan(int(decode.size))
    if prefill.size:
        meta.prefill_q_start = next(views)
        meta.prefill_q_len = next(views)
        meta.prefill_seq_lens = next(views)
        meta.prefill_page_table = next(views).view(prefill.size, pre_width)
        meta.prefill_max_q_len = int(lens[prefill].max())
        meta.prefills = [  # the reference backend's per-request view of the same table
            PrefillSeq(qs, ql, sl, meta.prefill_page_table[i, : -(-sl // ps)])
            for i, (qs, ql, sl) in enumerate(
                zip(
                    q_start[prefill].tolist(),
                    lens[prefill].tolist(),
                    seq_lens[prefill].tolist(),
                )
            )
        ]
    return input_ids, pos_dev, meta, sample_rows


def pipelined_ids(reqs: list[StepRow], prev, stage: HostStaging) -> torch.Tensor:
    """The input tokens of a step queued after `prev` (an InFlightDecode; the ids packed
    as pack_step packs them): a placeholder -1, a request's last input token, is the
    token `prev` samples for it, read on the device; the other tokens are as given."""
    if isinstance(reqs, StepRows) and reqs.blind:  # one placeholder a row: no columns read
        return prev.tokens.index_select(0, stage(_rows_in(reqs, prev.sampled)))
    lens, ids = token_columns(reqs)
    if (lens == 1).all() and (ids == -1).all():
        index = stage(_rows_in(reqs, prev.sampled))
        return prev.tokens.index_select(0, index)  # a decode step after a decode step
    at = {rid: i for i, rid in enumerate(request_ids(prev.sampled))}
    ends = np.cumsum(lens)
    holes = np.flatnonzero(ids[ends - 1] == -1)  # rows whose last input is a placeholder
    ids_of = request_ids(reqs)
    src = np.fromiter((at[ids_of[i]] for i in holes.tolist()), np.int64, holes.size)
    dev = stage(np.concatenate((ids, ends[holes] - 1, src)))
    total, n = ids.size, holes.size
    out = dev[:total]
    if n:
        out[dev[total : total + n]] = prev.tokens.index_select(0, dev[total + n :])
    return out


def _rows_in(reqs: list[StepRow], prior: list[StepRow]) -> np.ndarray:
    """Where each of `reqs` is in `prior` (every one is there): gathered by page row
    where both are `StepRows` (a row keeps its request, and its serial, while the runner
    holds it), else looked up by request id."""
    if isinstance(reqs, StepRows) and isinstance(prior, StepRows) and len(prior):
        at = np.full(int(max(prior.rows.max(), reqs.rows.max(initial=0))) + 1, -1, np.int64)
        at[prior.rows] = np.arange(len(prior))
        index = at[reqs.rows]
        if (index < 0).any() or (prior.serials[index] != reqs.serials).any():
            raise KeyError("a placeholder's request is not in the step before")
        return index
    at = {rid: i for i, rid in enumerate(request_ids(prior))}
    return np.fromiter((at[rid] for rid in request_ids(reqs)), np.int64, len(reqs))
