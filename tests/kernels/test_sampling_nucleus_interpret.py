"""Top-p sampling by draw-and-check (kernels/sampling_nucleus.py) under the Triton
interpreter (on the GPU when there is one): the token the cut-then-draw reference
picks, with the same noise, on every row, first draws rejected included."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.sampling import sample_tokens_reference
from batchgen.kernels.sampling_cut import top_p_cut_reference
from batchgen.kernels.sampling_nucleus import sample_nucleus

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
