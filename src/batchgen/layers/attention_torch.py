"""Reference attention over the paged KV cache, in plain torch.

Correct for any mix of prefill chunks and decodes, GQA, a cached prefix (the causal
mask is offset by it) and an optional sliding window. Math runs in float32.
Decodes are gathered into one batched attention; prefill chunks of the same query and
key counts run as one batched attention (a step of many short prompts ran hundreds of
small ones), each with its own shapes, so that a chunk's rows are what it alone gives
up to float32 rounding (a CPU's BLAS may block the batched product unlike a single one:
the same bits are batch-invariant mode's promise). In batch-invariant mode
(deterministic=True) both go through `batch_invariant.attend`, chunk by chunk, whose
result for a query depends on its position and its sequence's keys alone.

FP8 pages (kv_cache_dtype "fp8"): K/V are quantized as they are written
(`kv_quant.write_rows`) and upcast where they are read (the float32 math below).
"""

from __future__ import annotations

import torch

from batchgen.forward_context import AttentionMetadata, PrefillSeq, derived
from batchgen.kv_quant import write_rows
from batchgen.layers import batch_invariant


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into flat slots of the [pages, page_size, Hkv, D] caches
    (cast to the caches' dtype; FP8 saturated, kv_quant.to_cache)."""
    write_rows(k_cache.view(-1, *k_cache.shape[2:]), slot_mapping, k)
    write_rows(v_cache.view(-1, *v_cache.shape[2:]), slot_mapping, v)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, S, Hkv, D], allowed [B, Q, S] -> [B, Q, H, D] in q's dtype."""
    b, nq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, nq, hkv, h // hkv, d)
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k.float()) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v.float())
    return out.reshape(b, nq, h, v.shape[-1]).to(q.dtype)


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


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
    if meta.decode_rows is not None and meta.decode_rows.numel() > 0:
        table = meta.decode_page_table
        max_len = meta.decode_max_seq_len
        k = k_cache[table].flatten(1, 2)[:, :max_len]
        v = v_cache[table].flatten(1, 2)[:, :max_len]
        k_pos = torch.arange(max_len, device=q.device)[None, None, :]
        q_pos = (meta.decode_seq_lens - 1)[:, None, None]
        rows = q[meta.decode_rows][:, None]
        if batch_invariant.active():
            att = batch_invariant.attend(rows, k, v, q_pos[:, :, 0], scale, sliding_window)
            out[meta.decode_rows] = att[:, 0].to(q.dtype)
        else:
            allowed = _window_mask(q_pos, k_pos, sliding_window)
            out[meta.decode_rows] = _attend(rows, k, v, allowed, scale)[:, 0]
    if batch_invariant.active():
        for seq in meta.prefills:
            k = k_cache[seq.pages].flatten(0, 1)[: seq.seq_len][None]
            v = v_cache[seq.pages].flatten(0, 1)[: seq.seq_len][None]
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            q_pos = torch.arange(seq.seq_len - seq.q_len, seq.seq_len, device=q.device)[None]
            att = batch_invariant.attend(q[rows][None], k, v, q_pos, scale, sliding_window)
            out[rows] = att[0].to(q.dtype)
        return out
    for rows, pages, q_len, seq_len in derived(meta, "prefill_groups", lambda: _groups(meta)):
        k = k_cache[pages].flatten(1, 2)[:, :seq_len]
        v = v_cache[pages].flatten(1, 2)[:, :seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = _window_mask(q_pos, k_pos, sliding_window)[None].expand(len(rows), -1, -1)
        out[rows] = _attend(q[rows], k, v, allowed, scale)
    return out


def _groups(meta: AttentionMetadata) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """The step's prefill chunks grouped by (q_len, seq_len): per group its query rows
    [B, q_len] in the packed batch, its pages [B, pages], q_len and seq_len."""
    by_shape: dict[tuple[int, int], list[PrefillSeq]] = {}
    for seq in meta.prefills:
        by_shape.setdefault((seq.q_len, seq.seq_len), []).append(seq)
    groups = []
    for (q_len, seq_len), seqs in by_shape.items():
        pages = torch.stack([seq.pages for seq in seqs])
        starts = torch.tensor([seq.q_start for seq in seqs], device=pages.device)
        rows = starts[:, None] + torch.arange(q_len, device=pages.device)
        groups.append((rows, pages, q_len, seq_len))
    return groups
