"""PenaltyCounts.reserve: the slots a decode graph's sampler may read, held at once."""

from __future__ import annotations

import torch

from batchgen.runner.penalty_counts import PenaltyCounts

CPU = torch.device("cpu")


def test_reserve_keeps_the_counts_and_stops_growth():
    vocab = 11
    kept = PenaltyCounts(vocab, CPU)
    slots = kept.slots(["a", "b"], [[1, 2], [3]], [[4, 4], [5]], [2, 1])
    kept.record(["a", "b"], torch.tensor(slots), torch.tensor([6, 7]))
    before = kept.counts[slots].clone(), kept.prompt[slots].clone()
    kept.reserve(40)
    assert kept.counts.shape == (40, vocab) and kept.prompt.shape == (40, vocab)
    assert torch.equal(kept.counts[slots], before[0]) and torch.equal(kept.prompt[slots], before[1])
    assert kept.counts[slots[0]].tolist() == [0, 0, 0, 0, 2, 0, 1, 0, 0, 0, 0]
    ptr = kept.counts.data_ptr()
    ids = [f"r{i}" for i in range(38)]
    more = kept.slots(ids, [[0]] * 38, [[]] * 38, [0] * 38)
    assert kept.counts.data_ptr() == ptr  # 40 slots held: no growth
    assert sorted(more + slots) == list(range(40))
    assert kept.counts[more].sum() == 0 and kept.prompt[more][:, 0].all()
    kept.reserve(10)  # fewer than held: nothing changes
    assert kept.counts.data_ptr() == ptr
