"""The batch sampling kernel (kernels/sampling.py) under the Triton interpreter (on the
GPU when there is one) against its torch references."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.sampling import (
    gumbel_noise_reference,
    hash32_reference,
    sample_tokens,
    sample_tokens_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")
SEEDS = [0, 1, -1, 2**62 + 5, -(2**63), 12345]  # both halves of the 64 bits, signs


def rows_case(rows: int, vocab: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.2
    temperature[::3] = 0.0  # greedy rows among sampled ones
    seeds = torch.tensor([SEEDS[i % len(SEEDS)] for i in range(rows)], dtype=torch.int64)
    positions = torch.randint(0, 2**40, (rows,), generator=gen)
    return [t.to(DEVICE) for t in (logits, temperature, seeds, positions)]


def test_hash_is_the_32_bit_finaliser():
    """The reference's split products equal the 32-bit wrapped ones numpy computes."""
    import numpy as np

    x = torch.tensor([0, 1, 2, 0xFFFFFFFF, 0x12345678, 0x80000000], dtype=torch.int64)
    with np.errstate(over="ignore"):
        v = x.numpy().astype(np.uint32)
        v = v ^ (v >> np.uint32(16))
        v = v * np.uint32(0x7FEB352D)
        v = v ^ (v >> np.uint32(15))
        v = v * np.uint32(0x846CA68B)
        v = v ^ (v >> np.uint32(16))
    assert hash32_reference(x).tolist() == v.astype(np.int64).tolist()
    assert len(set(hash32_reference(torch.arange(5000)).tolist())) == 5000  # a bijection


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(6, 20000), (7, 1000), (3, 5)])
def test_tokens_match_the_reference(dtype, rows, vocab):
    """Greedy and sampled rows in one launch; vocabularies of several chunks (8,192
    tokens a program) and of one short block."""
    logits, temperature, seeds, positions = rows_case(rows, vocab, rows * vocab, dtype)
    got = sample_tokens(logits, temperature, seeds, positions)
    want = sample_tokens_reference(logits, temperature, seeds, positions)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert got.tolist() == want.tolist()
    greedy = temperature == 0
    assert torch.equal(got[greedy], logits[greedy].float().argmax(dim=1))
    assert not torch.equal(got[~greedy], logits[~greedy].float().argmax(dim=1))


def test_noise_bits_match_the_reference():
    """Flat logits at temperature 1: the token is the argmax of the noise alone."""
    rows, vocab = 6, 9000
    seeds = torch.tensor(SEEDS, dtype=torch.int64)
    positions = torch.tensor([0, 1, 2, 3, 2**33 + 1, 7], dtype=torch.int64)
    noise = gumbel_noise_reference(seeds, positions, vocab)
    got = sample_tokens(
        torch.zeros(rows, vocab, device=DEVICE),
        torch.ones(rows, device=DEVICE),
        seeds.to(DEVICE),
        positions.to(DEVICE),
    )
    assert got.tolist() == noise.argmax(dim=1).tolist()
    assert len(set(got.tolist())) == rows  # seeds and positions change the draw


def test_cut_keeps_only_tokens_at_or_above_it():
    rows, vocab = 8, 3000
    logits, temperature, seeds, positions = rows_case(rows, vocab, 3)
    cut = logits.sort(dim=1, descending=True).values[:, 4].contiguous()  # the top 5 stay
    cut[1] = -INF
    got = sample_tokens(logits, temperature, seeds, positions, cut)
    want = sample_tokens_reference(logits, temperature, seeds, positions, cut)
    assert got.tolist() == want.tolist()
    kept = logits.gather(1, got[:, None]).squeeze(1) >= cut
    assert kept.all()


def test_wrapper_checks_inputs():
    logits, temperature, seeds, positions = rows_case(2, 10, 0)
    with pytest.raises(ValueError, match="seeds"):
        sample_tokens(logits, temperature, seeds.int(), positions)
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(logits.t(), temperature, seeds, positions)
    with pytest.raises(ValueError, match="cut"):
        sample_tokens(logits, temperature, seeds, positions, torch.zeros(3, device=DEVICE))
    assert sample_tokens(logits[:0], temperature[:0], seeds[:0], positions[:0]).numel() == 0
