"""attention_torch.paged_attention's prefill chunks: those of one shape run as one batch,
each chunk's rows what it alone gives (the same bits in batch-invariant mode; up to float32
rounding otherwise, as the CPU's BLAS may block a batched product unlike a single one) and
what plain causal attention gives."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.forward_context import AttentionMetadata, PrefillSeq
from batchgen.layers import attention_torch, batch_invariant

PAGE, KV_HEADS, GROUP, DIM, SCALE = 4, 2, 2, 16, 0.3


def _meta(chunks: list[tuple[int, int, list[int]]]) -> AttentionMetadata:
    """Prefill-only metadata; chunks: (tokens already cached, new tokens, pages)."""
    slots, prefills, row = [], [], 0
    for start, n, table in chunks:
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(start, start + n)]
        prefills.append(PrefillSeq(row, n, start + n, torch.tensor(table)))
        row += n
    meta = AttentionMetadata(num_tokens=row, slot_mapping=torch.tensor(slots))
    meta.prefills = prefills
    return meta


def _plain(q, keys, values, start: int, window: int | None) -> torch.Tensor:
    """Causal attention of queries at positions start.. over keys 0.., GQA by repeat."""
    keys = keys.repeat_interleave(GROUP, dim=1)
    values = values.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, keys) * SCALE
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, values)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_chunks_of_one_shape_give_what_each_gives_alone(window, deterministic):
    gen = torch.Generator().manual_seed(0)
    # (cached, new): three fresh 7-token prompts, two 6-token chunks after 3 cached, one other
    shapes = [(0, 7), (3, 6), (0, 7), (3, 6), (0, 2), (0, 7)]
    counts = [math.ceil((start + n) / PAGE) for start, n in shapes]
    pages = torch.randperm(sum(counts) + 3, generator=gen).tolist()
    tables = [pages[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(shapes))]
    chunks = [(start, n, table) for (start, n), table in zip(shapes, tables)]
    k_cache = torch.randn(len(pages), PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(len(pages), PAGE, KV_HEADS, DIM, generator=gen)
    q = torch.randn(sum(n for _, n in shapes), KV_HEADS * GROUP, DIM, generator=gen)

    with batch_invariant.invariant_mode(deterministic):
        out = attention_torch.paged_attention(q, k_cache, v_cache, _meta(chunks), SCALE, window)
        alones = [
            attention_torch.paged_attention(
                q[row : row + n], k_cache, v_cache, _meta([(start, n, table)]), SCALE, window
            )
            for row, (start, n, table) in zip(_starts(chunks), chunks)
        ]
    row = 0
    for (start, n, table), alone in zip(chunks, alones):
        mine = q[row : row + n]
        if deterministic:
            assert torch.equal(out[row : row + n], alone)
        else:
            torch.testing.assert_close(out[row : row + n], alone)
        keys = k_cache[table].flatten(0, 1)[: start + n]
        values = v_cache[table].flatten(0, 1)[: start + n]
        torch.testing.assert_close(alone, _plain(mine, keys, values, start, window))
        row += n


def _starts(chunks) -> list[int]:
    """Each chunk's first row in the packed batch."""
    return [sum(n for _, n, _ in chunks[:i]) for i in range(len(chunks))]
