"""Top-p sampling by draw-and-check (kernels/sampling_nucleus.py) under the Triton
interpreter (on the GPU when there is one): the token the cut-then-draw reference
picks, with the same noise, on every row, first draws rejected included."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.sampling import sample_tokens_reference
from batchgen.kernels.sampling_nucleus import sample_nucleus, top_p_cut_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")
TOP_P = [0.9, 0.3, 0.5, 0.95, 1.0, 0.1, 0.8, 0.99, 0.6, 0.2, 0.7, 0.4]


def case(seed: int, vocab: int, dtype=torch.float32, ties=False):
    gen = torch.Generator().manual_seed(seed)
    rows = len(TOP_P)
    logits = torch.randn(rows, vocab, generator=gen) * float(torch.rand(1, generator=gen) * 4 + 0.5)
    if ties:
        logits = logits.round()
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.2
    temperature[0] = 0.0  # a greedy row
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 1000, (rows,), generator=gen)
    cut = torch.full((rows,), -INF)
    cut[3] = float(logits[3].quantile(0.6))  # rows min_p / top_k cut before
    cut[6] = float(logits[6].quantile(0.99))
    out = (logits.to(dtype), temperature, seeds, positions, torch.tensor(TOP_P), cut)
    return [t.to(DEVICE) for t in out]


@pytest.mark.parametrize(
    "seed,vocab,dtype,ties",
    [(0, 3000, torch.float32, False), (1, 20000, torch.float32, True),
     (2, 777, torch.bfloat16, False)],
)  # fmt: skip
@pytest.mark.parametrize("with_cut", [False, True])
def test_draw_and_check_picks_the_cut_then_draw_token(seed, vocab, dtype, ties, with_cut):
    logits, temperature, seeds, positions, top_p, cut = case(seed, vocab, dtype, ties)
    before = cut if with_cut else None
    got = sample_nucleus(logits, temperature, seeds, positions, top_p, before)
    nucleus = top_p_cut_reference(logits, temperature, top_p, cut if with_cut else cut * 0 - INF)
    want = sample_tokens_reference(logits, temperature, seeds, positions, nucleus)
    assert torch.equal(got, want)
    first = sample_tokens_reference(logits, temperature, seeds, positions, before)
    assert (first != want).sum() >= 2  # draws outside the nucleus, drawn again
    assert got[0] == logits[0].float().argmax()  # the greedy row


def test_wrapper_checks_top_p():
    logits, temperature, seeds, positions, top_p, _ = case(0, 300)
    with pytest.raises(ValueError, match="top_p"):
        sample_nucleus(logits, temperature, seeds, positions, top_p.double())
    empty = sample_nucleus(logits[:0], temperature[:0], seeds[:0], positions[:0], top_p[:0])
    assert empty.shape == (0,)


def cut_case(seed: int, rows: int = 7, vocab: int = 3000):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[5] = logits[5].round()  # many ties, some at the nucleus edge
    temperature = torch.tensor([1.0, 0.7, 0.0, 2.0, 1.0, 1.0, 0.3])[:rows]
    top_p = torch.tensor([0.9, 0.5, 0.5, 0.99, 1.0, 0.6, 0.95])[:rows]
    cut = torch.full((rows,), -INF)
    cut[1], cut[4] = 0.5, 1.0  # min_p / top_k left these
    return [t.to(DEVICE) for t in (logits, temperature, top_p, cut)]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_reference_cut_keeps_greedy_and_full_rows_and_cuts_the_others(seed):
    logits, temperature, top_p, cut = cut_case(seed)
    got = top_p_cut_reference(logits, temperature, top_p, cut)
    assert got[2] == -INF and got[4] == 1.0  # greedy and top_p 1 keep their cut
    assert (got[[0, 1, 3, 5, 6]] > cut[[0, 1, 3, 5, 6]]).all()  # the others cut more


def test_the_reference_cut_is_the_smallest_set_reaching_p():
    """Mass kept >= p, and without the edge value's tokens < p (ties kept whole)."""
    logits, temperature, top_p, cut = cut_case(2)
    got = top_p_cut_reference(logits, temperature, top_p, cut)
    for r in (0, 1, 3, 5, 6):
        x = logits[r].double()
        x = x.masked_fill(x < cut[r], -INF)
        probs = torch.softmax(x / temperature[r].double(), dim=0)
        kept = probs[x >= got[r]].sum()
        assert kept >= top_p[r] - 1e-6
        assert probs[x > got[r]].sum() < top_p[r]
    assert int((logits[5] == got[5]).sum()) > 1  # a tie at the edge, kept whole
