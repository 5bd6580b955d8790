"""Triton attention backend: the semantics of attention_torch, on the paged-attention kernels.

Decode rows (q_len == 1) go through decode_attention in one launch (split along the
sequence when the batch is small); prefill chunks go through prefill_attention in one
launch from the padded prefill tensors. Both write straight into the packed output rows.
In batch-invariant mode (deterministic=True, layers/batch_invariant.py) both go through
kernels/invariant_attention.py instead: keys in blocks fixed by position, never split by
the batch, a decoded token the same bits as the same token prefilled.
"""

from __future__ import annotations

import torch

from batchgen.forward_context import AttentionMetadata
from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.invariant_attention import invariant_attention, invariant_decode
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.store_kv import store_kv  # noqa: F401  (the backend's K/V write)
from batchgen.layers import batch_invariant


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; every query's own K/V must already be in the cache."""
    out = torch.empty_like(q)
    invariant = batch_invariant.active()
    if meta.decode_rows is not None and meta.decode_rows.numel() > 0:
        decode, splits = invariant_decode, {}  # never splits the keys by the batch
        if not invariant:
            decode = decode_attention
            splits = {"max_seq_len": meta.decode_max_seq_len or None}
            splits["num_splits"] = meta.decode_num_splits
        decode(
            q,
            k_cache,
            v_cache,
            meta.decode_page_table,
            meta.decode_seq_lens,
            scale,
            sliding_window,
            rows=meta.decode_rows,
            out=out,
            **splits,
        )
    if meta.prefills or (meta.prefill_q_len is not None and meta.prefill_q_len.numel() > 0):
        q_start, q_len, seq_lens, table, max_q_len = padded_prefills(meta, q.device)
        attend = invariant_attention if invariant else prefill_attention
        attend(
            q,
            k_cache,
            v_cache,
            q_start,
            q_len,
            seq_lens,
            table,
            max_q_len,
            scale,
            sliding_window,
            out=out,
        )
    return out


def padded_prefills(meta: AttentionMetadata, device: torch.device):
    """The padded prefill tensors (q_start, q_len, seq_lens, page table, max_q_len); built
    from meta.prefills when the runner left them out."""
    if meta.prefill_q_len is not None:
        return (
            meta.prefill_q_start,
            meta.prefill_q_len,
            meta.prefill_seq_lens,
            meta.prefill_page_table,
            meta.prefill_max_q_len,
        )
    seqs = meta.prefills
    width = max(seq.pages.numel() for seq in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int64, device=device)
    for i, seq in enumerate(seqs):
        table[i, : seq.pages.numel()] = seq.pages
    q_start, q_len, seq_lens = (
        torch.tensor(values, dtype=torch.int64, device=device)
        for values in zip(*[(s.q_start, s.q_len, s.seq_len) for s in seqs])
    )
    return q_start, q_len, seq_lens, table, max(s.q_len for s in seqs)
