"""The one-pass penalty kernel (kernels/penalties.py) under the Triton interpreter (on the
GPU when there is one) against its op-by-op torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.penalties import penalized_logits, penalized_logits_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(rows: int, vocab: int, seed: int, dtype=torch.float32, prompt=True):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[0, :5] = float("-inf")  # min_tokens-blocked tokens stay blocked
    counts = torch.randint(0, 4, (rows, vocab), generator=gen, dtype=torch.int32)
    counts[torch.rand(rows, vocab, generator=gen) < 0.7] = 0
    mask = torch.rand(rows, vocab, generator=gen) < 0.2 if prompt else None
    rep = torch.rand(rows, generator=gen) * 1.5 + 0.5  # below and above 1
    freq = torch.randn(rows, generator=gen) * 0.7  # negative ones too
    pres = torch.randn(rows, generator=gen) * 0.7
    rep[1], freq[1], pres[1] = 1.0, 0.0, 0.0  # a row without penalties
    out = [logits, counts, mask, rep, freq, pres]
    return [None if t is None else t.to(DEVICE) for t in out]


@pytest.mark.parametrize(
    "rows,vocab,dtype,prompt",
    [
        (3, 5000, torch.float32, True),
        (4, 777, torch.bfloat16, True),
        (2, 4100, torch.float32, False),
    ],
)
def test_penalties_match_the_reference_bit_for_bit(rows, vocab, dtype, prompt):
    args = case(rows, vocab, rows + vocab, dtype, prompt)
    got = penalized_logits(*args)
    want = penalized_logits_reference(*args)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(got[1], args[0][1].float())  # the unpenalised row is its logits
    assert not torch.equal(got[0], args[0][0].float())
    assert (got[0, :5] == float("-inf")).all()


def test_kept_counts_are_read_at_their_slots():
    """counts and mask as a PenaltyCounts keeps them ([slots, V]), rows naming each row's
    slot: what the gathered [B, V] tensors give, without gathering them."""
    logits, counts, mask, rep, freq, pres = case(3, 900, 5)
    rows = torch.tensor([2, 0, 2], device=DEVICE)  # two rows on one slot
    slots_counts = torch.roll(counts, 1, 0)
    slots_mask = torch.roll(mask, 1, 0)
    got = penalized_logits(logits, slots_counts, slots_mask, rep, freq, pres, rows)
    gathered = (slots_counts[rows], slots_mask[rows])
    assert torch.equal(got, penalized_logits_reference(logits, *gathered, rep, freq, pres))
    assert torch.equal(
        got, penalized_logits_reference(logits, slots_counts, slots_mask, rep, freq, pres, rows)
    )
    assert not torch.equal(got, penalized_logits(logits, counts, mask, rep, freq, pres))


def test_wrapper_checks_inputs():
    logits, counts, mask, rep, freq, pres = case(2, 300, 0)
    with pytest.raises(ValueError, match="counts"):
        penalized_logits(logits, counts.long(), mask, rep, freq, pres)
    with pytest.raises(ValueError, match="prompt_mask"):
        penalized_logits(logits, counts, mask[:, :10], rep, freq, pres)
    with pytest.raises(ValueError, match="rows"):
        penalized_logits(logits, counts, mask, rep, freq, pres, rep.long()[:1])
    with pytest.raises(ValueError, match="frequency"):
        penalized_logits(logits, counts, mask, rep, freq.double(), pres)
    assert penalized_logits(
        logits[:0], counts[:0], mask[:0], rep[:0], freq[:0], pres[:0]
    ).shape == (0, 300)
