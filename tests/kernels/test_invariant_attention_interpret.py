"""kernels/invariant_attention.py: each row's attention has the same bits alone, in a batch
of mixed lengths, in another batch order, with other page ids, prefilled in one chunk or
several, decoded or prefilled, in a graph batch's padding; and it is attention (close to
the torch reference). TRITON_INTERPRET=1 on the CPU, float32."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.invariant_attention import invariant_attention, invariant_decode

PAGE = 4
LENS = [37, 5, 18, 1, 29]


class Seqs:
    """Random K/V (and queries for every position) of len(LENS) sequences in a paged cache
    whose page ids are shuffled; `mla`: one latent head, k = latent[..., :c] plus a rope
    part latent[..., c:], v = latent[..., :c]."""

    def __init__(self, heads=4, kv_heads=2, dim=16, mla=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.mla = heads, mla
        pages_each = [-(-n // PAGE) for n in LENS]
        total = sum(pages_each) + 3
        order = torch.randperm(total, generator=gen)
        self.tables, first = [], 0
        for n in pages_each:
            self.tables.append(order[first : first + n])
            first += n
        if mla:
            self.c, rope = 32, 16
            self.cache = torch.randn(total, PAGE, 1, self.c + rope, generator=gen)
            self.k = self.cache[..., : self.c]
            self.v = self.k
            self.k_rope = self.cache[..., self.c :]
            self.q = [torch.randn(n, heads, self.c, generator=gen) for n in LENS]
            self.q_rope = [torch.randn(n, heads, rope, generator=gen) for n in LENS]
        else:
            self.k = torch.randn(total, PAGE, kv_heads, dim, generator=gen)
            self.v = torch.randn(total, PAGE, kv_heads, dim, generator=gen)
            self.k_rope = None
            self.q = [torch.randn(n, heads, dim, generator=gen) for n in LENS]
            self.q_rope = None
        self.scale = 0.3

    def table(self, seqs):
        width = max(len(self.tables[s]) for s in seqs)
        out = torch.zeros(len(seqs), width, dtype=torch.int64)
        for i, s in enumerate(seqs):
            out[i, : len(self.tables[s])] = self.tables[s]
        return out

    def prefill(self, chunks, window=None):
        """chunks: (sequence, start, end) query ranges, packed in that order; returns each
        chunk's output rows [end - start, H, Dv]."""
        q = torch.cat([self.q[s][a:b] for s, a, b in chunks])
        q_rope = (
            None if self.q_rope is None else torch.cat([self.q_rope[s][a:b] for s, a, b in chunks])
        )
        lens = [b - a for _, a, b in chunks]
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        out = invariant_attention(
            q, self.k, self.v, starts, torch.tensor(lens), torch.tensor([b for _, _, b in chunks]),
            self.table([s for s, _, _ in chunks]), max(lens), self.scale, window,
            q_rope=q_rope, k_rope=self.k_rope,
        )  # fmt: skip
        return list(out.split(lens))

    def decode(self, seqs, pad=0, window=None):
        """Each sequence's last query decoded, with `pad` graph padding rows after them
        (a one-token context on page 0); returns [len(seqs), H, Dv]."""
        q = torch.stack([self.q[s][-1] for s in seqs] + [self.q[0][0]] * pad)
        q_rope = None
        if self.q_rope is not None:
            q_rope = torch.stack([self.q_rope[s][-1] for s in seqs] + [self.q_rope[0][0]] * pad)
        table = torch.cat(
            [self.table(seqs), torch.zeros(pad, self.table(seqs).shape[1], dtype=torch.int64)]
        )
        seq_lens = torch.tensor([LENS[s] for s in seqs] + [1] * pad)
        out = invariant_decode(
            q, self.k, self.v, table, seq_lens, self.scale, window,
            q_rope=q_rope, k_rope=self.k_rope,
        )  # fmt: skip
        return out[: len(seqs)]

    def reference(self, s, window=None):
        """torch attention of sequence s's every query, [n, H, Dv]."""
        n = LENS[s]
        keys = self.k[self.tables[s]].flatten(0, 1)[:n]  # [n, Hkv, D]
        values = self.v[self.tables[s]].flatten(0, 1)[:n]
        g = self.heads // keys.shape[1]
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", self.q[s], keys)
        if self.mla:
            rope = self.k_rope[self.tables[s]].flatten(0, 1)[:n, 0]
            scores = scores + torch.einsum("qhr,kr->hqk", self.q_rope[s], rope)
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        probs = torch.softmax((scores * self.scale).masked_fill(~allowed, float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", probs, values)


CASES = {
    "gqa": dict(heads=4, kv_heads=2),
    "mha": dict(heads=2, kv_heads=2),
    "mla": dict(heads=4, mla=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_rows_same_bits_in_any_batch_and_chunking(case, window):
    seqs = Seqs(**CASES[case])
    if case == "mla" and window is not None:
        pytest.skip("MLA has no sliding window")
    whole = [(s, 0, n) for s, n in enumerate(LENS)]
    batch = seqs.prefill(whole, window)
    for s in range(len(LENS)):
        torch.testing.assert_close(batch[s], seqs.reference(s, window), atol=1e-5, rtol=1e-5)
    alone = [seqs.prefill([(s, 0, n)], window)[0] for s, n in enumerate(LENS)]
    backwards = seqs.prefill(whole[::-1], window)[::-1]
    # chunked at other cut points: sequence 0 in 3 pieces, 2 in 2, batched with others
    pieces = (
        [(0, 0, 9), (2, 0, 11), (4, 0, 29)],
        [(0, 9, 30), (2, 11, 18), (1, 0, 5)],
        [(3, 0, 1), (0, 30, 37)],
    )
    chunked = {}
    for step in pieces:
        for (s, a, _), rows in zip(step, seqs.prefill(list(step), window)):
            chunked.setdefault(s, []).append((a, rows))
    for s in range(len(LENS)):
        assert torch.equal(alone[s], batch[s]), s
        assert torch.equal(backwards[s], batch[s]), s
        assert torch.equal(
            torch.cat([r for _, r in sorted(chunked[s], key=lambda x: x[0])]), batch[s]
        ), s


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_rows_same_bits_alone_batched_padded_and_as_prefill(case):
    seqs = Seqs(**CASES[case], seed=1)
    order = [0, 1, 2, 3, 4]
    batch = seqs.decode(order)
    shuffled = seqs.decode([3, 0, 4, 2, 1])
    padded = seqs.decode(order, pad=3)  # a CUDA graph bucket's padding rows
    prefilled = seqs.prefill([(s, 0, n) for s, n in enumerate(LENS)])
    for s in order:
        alone = seqs.decode([s])[0]
        assert torch.equal(alone, batch[s]), s
        assert torch.equal(shuffled[[3, 0, 4, 2, 1].index(s)], batch[s]), s
        assert torch.equal(padded[s], batch[s]), s
        # the last token decoded has the bits of the same token prefilled
        assert torch.equal(prefilled[s][-1], batch[s]), s
        torch.testing.assert_close(batch[s], seqs.reference(s)[-1], atol=1e-5, rtol=1e-5)


def test_decode_with_a_window_matches_prefill():
    seqs = Seqs(seed=2)
    decoded = seqs.decode([0, 2, 4], window=7)
    prefilled = seqs.prefill([(0, 0, 37), (2, 0, 18), (4, 0, 29)], window=7)
    for i in range(3):
        assert torch.equal(decoded[i], prefilled[i][-1])


def test_rejects_misfit_rope():
    seqs = Seqs(mla=True)
    with pytest.raises(ValueError, match="both q_rope and k_rope"):
        invariant_decode(
            torch.stack([q[-1] for q in seqs.q]), seqs.k, seqs.v, seqs.table(range(5)),
            torch.tensor(LENS), 0.3, q_rope=torch.stack([q[-1] for q in seqs.q_rope]),
        )  # fmt: skip
