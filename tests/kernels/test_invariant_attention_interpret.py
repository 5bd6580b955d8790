"""kernels/invariant_attention.py: each row's attention has the same bits alone, in a batch
of mixed lengths, in another batch order, with other page ids, prefilled in one chunk or
several, decoded or prefilled, in a graph batch's padding; and it is attention (close to
the torch reference). TRITON_INTERPRET=1 on the CPU, float32."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchgen.kernels.invariant_attention import invariant_attention, invariant_decode
from batchgen.kv_quant import FP8, to_cache

PAGE = 4
LENS = [37, 5, 18, 1, 29]


class Seqs:
    """Random K/V (and queries for every position) of sequences of `lens` tokens in a paged cache
    whose page ids are shuffled; `mla`: one latent head, k = latent[..., :c] plus a rope
    part latent[..., c:], v = latent[..., :c]."""

    def __init__(
        self, heads=4, kv_heads=2, dim=16, mla=False, seed=0, lens=LENS, lora=32, rope=16,
        device="cpu", dtype=torch.float32,
    ):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.mla, self.lens = heads, mla, lens

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        pages_each = [-(-n // PAGE) for n in lens]
        total = sum(pages_each) + 3
        order = torch.randperm(total, generator=gen)
        self.tables, first = [], 0
        for n in pages_each:
            self.tables.append(order[first : first + n].to(device))
            first += n
        if mla:
            self.c = lora
            self.cache = rand(total, PAGE, 1, lora + rope)
            self.k = self.cache[..., :lora]
            self.v = self.k
            self.k_rope = self.cache[..., lora:]
            self.q = [rand(n, heads, lora) for n in lens]
            self.q_rope = [rand(n, heads, rope) for n in lens]
        else:
            self.k = rand(total, PAGE, kv_heads, dim)
            self.v = rand(total, PAGE, kv_heads, dim)
            self.k_rope = None
            self.q = [rand(n, heads, dim) for n in lens]
            self.q_rope = None
        self.scale = 0.3 if device == "cpu" else 1 / (lora if mla else dim) ** 0.5
        self.device = device

    def table(self, seqs):
        width = max(len(self.tables[s]) for s in seqs)
        out = torch.zeros(len(seqs), width, dtype=torch.int64, device=self.device)
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
        dev = dict(device=self.device)
        starts = torch.tensor([0] + lens[:-1], **dev).cumsum(0)
        ends = torch.tensor([b for _, _, b in chunks], **dev)
        out = invariant_attention(
            q, self.k, self.v, starts, torch.tensor(lens, **dev), ends,
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
        table = self.table(seqs)
        table = torch.cat([table, table.new_zeros(pad, table.shape[1])])
        seq_lens = torch.tensor([self.lens[s] for s in seqs] + [1] * pad, device=self.device)
        out = invariant_decode(
            q, self.k, self.v, table, seq_lens, self.scale, window,
            q_rope=q_rope, k_rope=self.k_rope,
        )  # fmt: skip
        return out[: len(seqs)]

    def reference(self, s, window=None):
        """torch attention of sequence s's every query, [n, H, Dv] (float32)."""
        n = self.lens[s]
        keys = self.k[self.tables[s]].flatten(0, 1)[:n]  # [n, Hkv, D]
        values = self.v[self.tables[s]].flatten(0, 1)[:n]
        g = self.heads // keys.shape[1]
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        keys, values = keys.float(), values.float()
        scores = torch.einsum("qhd,khd->hqk", self.q[s].float(), keys)
        if self.mla:
            rope = self.k_rope[self.tables[s]].flatten(0, 1)[:n, 0].float()
            scores = scores + torch.einsum("qhr,kr->hqk", self.q_rope[s].float(), rope)
        pos = torch.arange(n, device=self.device)
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
# the GPU's: real head widths, bf16, sequences over several 64-key blocks
GPU_LENS = [300, 5, 130, 1, 257]
GPU_CASES = {
    "gqa": dict(heads=8, kv_heads=2, dim=128),
    "mla": dict(heads=16, mla=True, lora=512, rope=64),
}
GPU = dict(device="cuda", dtype=torch.bfloat16, lens=GPU_LENS)


def _pieces(lens) -> list[list[tuple[int, int, int]]]:
    """Three prefill steps cutting every sequence at a third and two thirds of its
    length (empty pieces left out), the middle step's requests in reverse order."""
    cuts = [(0, n // 3, 2 * n // 3, n) for n in lens]
    steps = [[(s, c[i], c[i + 1]) for s, c in enumerate(cuts) if c[i + 1] > c[i]] for i in range(3)]
    steps[1].reverse()
    return steps


def check_prefill(seqs: Seqs, window=None, tol=1e-5) -> None:
    """Each sequence's prefill rows: close to the reference, and the same bits alone, in
    the batch, in reverse order and chunked at other cut points beside other requests."""
    whole = [(s, 0, n) for s, n in enumerate(seqs.lens)]
    batch = seqs.prefill(whole, window)
    for s in range(len(seqs.lens)):
        ref = seqs.reference(s, window)
        torch.testing.assert_close(batch[s].float(), ref, atol=tol, rtol=tol)
    alone = [seqs.prefill([(s, 0, n)], window)[0] for s, n in enumerate(seqs.lens)]
    backwards = seqs.prefill(whole[::-1], window)[::-1]
    chunked = {}
    for step in _pieces(seqs.lens):
        for (s, a, _), rows in zip(step, seqs.prefill(step, window)):
            chunked.setdefault(s, []).append((a, rows))
    for s in range(len(seqs.lens)):
        assert torch.equal(alone[s], batch[s]), s
        assert torch.equal(backwards[s], batch[s]), s
        pieces = torch.cat([r for _, r in sorted(chunked[s], key=lambda x: x[0])])
        assert torch.equal(pieces, batch[s]), s


def check_decode(seqs: Seqs, tol=1e-5) -> None:
    """Each sequence's last token decoded: the same bits alone, batched, shuffled, beside
    a graph bucket's padding rows, and as the same token prefilled; close to the
    reference."""
    order, shuffle = [0, 1, 2, 3, 4], [3, 0, 4, 2, 1]
    batch = seqs.decode(order)
    shuffled = seqs.decode(shuffle)
    padded = seqs.decode(order, pad=3)  # a CUDA graph bucket's padding rows
    prefilled = seqs.prefill([(s, 0, n) for s, n in enumerate(seqs.lens)])
    for s in order:
        alone = seqs.decode([s])[0]
        assert torch.equal(alone, batch[s]), s
        assert torch.equal(shuffled[shuffle.index(s)], batch[s]), s
        assert torch.equal(padded[s], batch[s]), s
        # the last token decoded has the bits of the same token prefilled
        assert torch.equal(prefilled[s][-1], batch[s]), s
        ref = seqs.reference(s)[-1]
        torch.testing.assert_close(batch[s].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_rows_same_bits_in_any_batch_and_chunking(case, window):
    if case == "mla" and window is not None:
        pytest.skip("MLA has no sliding window")
    check_prefill(Seqs(**CASES[case]), window)


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_rows_same_bits_alone_batched_padded_and_as_prefill(case):
    check_decode(Seqs(**CASES[case], seed=1))


@pytest.mark.parametrize("case", [pytest.param("mla", marks=pytest.mark.slow), "straddle"])
def test_tiles_a_program_takes_leave_every_row_alone(case):
    """1, 2 or 4 tiles a program (sharing each block of keys) give the same bits, also
    where a query's heads straddle two tiles (3 heads a KV head, 16-row tiles) and for an
    MLA decode row whose 20 heads fill two."""
    from batchgen.kernels.invariant_attention import CPU_TUNING

    kw = dict(heads=20, mla=True) if case == "mla" else dict(heads=3, kv_heads=1)
    seqs = Seqs(**kw, seed=4)
    outs = []
    for subtiles in (1, 2, 4):
        tuning = replace(CPU_TUNING, subtiles=subtiles)
        q = torch.cat(seqs.q)
        q_rope = None if seqs.q_rope is None else torch.cat(seqs.q_rope)
        lens = torch.tensor(LENS)
        starts = torch.tensor([0] + LENS[:-1]).cumsum(0)
        out = invariant_attention(
            q, seqs.k, seqs.v, starts, lens, lens, seqs.table(range(5)), max(LENS),
            seqs.scale, q_rope=q_rope, k_rope=seqs.k_rope, tuning=tuning,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    prefilled = outs[0].split(LENS)
    decoded = seqs.decode(range(5))
    for s in range(5):
        assert torch.equal(decoded[s], prefilled[s][-1]), s
        torch.testing.assert_close(prefilled[s], seqs.reference(s), atol=1e-5, rtol=1e-5)


def test_decode_with_a_window_matches_prefill():
    seqs = Seqs(seed=2)
    decoded = seqs.decode([0, 2, 4], window=7)
    prefilled = seqs.prefill([(0, 0, 37), (2, 0, 18), (4, 0, 29)], window=7)
    for i in range(3):
        assert torch.equal(decoded[i], prefilled[i][-1])


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_fp8_caches_keep_every_invariance(case):
    """FP8 pages (kv_cache_dtype "fp8"), upcast as loaded: the same checks."""
    seqs = Seqs(**CASES[case], seed=3)
    if seqs.mla:
        seqs.cache = to_cache(seqs.cache, FP8)
        seqs.k = seqs.v = seqs.cache[..., : seqs.c]
        seqs.k_rope = seqs.cache[..., seqs.c :]
    else:
        seqs.k, seqs.v = to_cache(seqs.k, FP8), to_cache(seqs.v, FP8)
    check_decode(seqs)
    check_prefill(seqs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_rows_same_bits_on_cuda(case):
    """The compiled kernels in bf16 on the tensor cores: the same invariances."""
    check_prefill(Seqs(**GPU_CASES[case], **GPU), tol=2e-2)
    check_decode(Seqs(**GPU_CASES[case], **GPU, seed=1), tol=2e-2)
    if case == "gqa":
        check_prefill(Seqs(**GPU_CASES[case], **GPU, seed=2), window=100, tol=2e-2)


def test_rejects_misfit_rope():
    seqs = Seqs(mla=True)
    with pytest.raises(ValueError, match="both q_rope and k_rope"):
        invariant_decode(
            torch.stack([q[-1] for q in seqs.q]), seqs.k, seqs.v, seqs.table(range(5)),
            torch.tensor(LENS), 0.3, q_rope=torch.stack([q[-1] for q in seqs.q_rope]),
        )  # fmt: skip
