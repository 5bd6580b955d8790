"""prepare_step's chunk index: built on the host in numpy as fla-core's builder would, and found
by chunk_kda in fla's cache under the arguments it passes. CPU; the GPU side (no wait
on the stream) is in test_kda_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from fla.ops.utils import index

from batchgen.layers import kda_ops


def _numbered(lens: list[int], chunk: int = 64) -> list[list[int]]:
    """(sequence, chunk within it) for each chunk of each sequence, in order."""
    return [[i, c] for i, n in enumerate(lens) for c in range((n + chunk - 1) // chunk)]


@pytest.mark.parametrize("seed", range(4))
def test_the_seeded_index_numbers_every_chunk(seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, 63, 64, 65, 128, 200, rng.randint(1, 500)]) for _ in range(9)]
    cu_host = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    got = kda_ops.seed_chunk_indices(cu_host.clone(), cu_host)
    assert got.dtype == torch.int32
    assert got.tolist() == _numbered(lens)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_seeded_index_equals_fla_s_own_builder(dtype):
    """Built in numpy, the index is bit for bit what fla's builder makes of the same
    lengths (empty sequences, exact chunk multiples, one sequence, none)."""
    build = index.prepare_chunk_indices.__wrapped__
    for lens in ([0, 64, 1, 65, 0, 300], [128], [3], []):
        cu_host = torch.tensor([0] + lens).cumsum(0).to(dtype)
        want = build(cu_seqlens=cu_host, chunk_size=64, cu_seqlens_cpu=cu_host)
        got = kda_ops.seed_chunk_indices(cu_host.clone(), cu_host)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_a_seeded_index_is_what_fla_hands_to_the_layers():
    cu_host = torch.tensor([0, 5, 140, 141], dtype=torch.int32)
    cu = cu_host.clone()  # the device copy on a GPU
    seeded = kda_ops.seed_chunk_indices(cu, cu_host)
    assert seeded.dtype == cu.dtype
    # chunk_kda's forward asks with these keywords (fla/ops/kda/chunk.py)
    got = index.prepare_chunk_indices(cu_seqlens=cu, chunk_size=64, cu_seqlens_cpu=cu_host)
    assert got is seeded
    other = cu_host.clone()  # another step's lengths: not the seeded entry
    assert (
        index.prepare_chunk_indices(cu_seqlens=other, chunk_size=64, cu_seqlens_cpu=other)
        is not seeded
    )


def test_without_fla_s_cache_fla_builds_the_index(monkeypatch):
    """Another fla-core whose cache is out of reach: the index is fla's own, equal."""
    assert kda_ops._identity_cache(index.prepare_chunk_indices) is not None  # this fla's
    monkeypatch.setattr(kda_ops, "_identity_cache", lambda fn: None)
    cu_host = torch.tensor([0, 70, 71, 200], dtype=torch.int32)
    got = kda_ops.seed_chunk_indices(cu_host.clone(), cu_host)
    assert got.tolist() == _numbered([70, 1, 129])
