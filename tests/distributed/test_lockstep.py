"""Lockstep (distributed/lockstep.py) on spawned gloo ranks: ranks that run different
numbers of forwards in a tick (none, one, two) still meet in every forward's collective,
the ones with fewer running dummy forwards, and leave each tick together."""

from __future__ import annotations

import torch
from torch import nn
from tp_workers import run_ranks

from batchgen.distributed.lockstep import Lockstep
from batchgen.layers.tp_group import TPGroup


class _Collective(nn.Module):
    """A forward that all-reduces its input over the group, as a MoE layer's all-to-all
    needs every rank: its outputs are the sums every rank saw."""

    def __init__(self, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(x.clone())
        self.seen.append(float(out.item()))
        return out


def _ticks(tp: TPGroup, plan: list[list[int]]) -> dict:
    """Run plan[rank][t] real forwards (each contributing 10 ** rank) in tick t, then
    end the tick with dummy forwards (contributing 0)."""
    model = _Collective(tp)
    lockstep = Lockstep(tp.host_group)
    lockstep.attach(model)
    dummies = []
    for count in plan[tp.rank]:
        for _ in range(count):
            model(torch.tensor([10.0**tp.rank]))
        dummies.append(lockstep.end_tick(lambda: model(torch.zeros(1))))
    return {"seen": model.seen, "dummies": dummies, "rounds": lockstep.rounds}


def test_ranks_with_different_forward_counts_pair_every_forward(tmp_path):
    plan = [[2, 0, 1, 1], [1, 1, 0, 2]]  # a pipelined start, an idle rank, both busy
    rank0, rank1 = run_ranks(_ticks, 2, tmp_path, plan)
    # both real (11), then rank 0 real beside rank 1's dummy (1); rank 1 alone (10);
    # rank 0 alone (1); both (11), then rank 1 alone (10)
    assert rank0["seen"] == rank1["seen"] == [11.0, 1.0, 10.0, 1.0, 11.0, 10.0]
    assert rank0["dummies"] == [0, 1, 0, 1] and rank1["dummies"] == [1, 0, 1, 0]
    assert rank0["rounds"] == rank1["rounds"] == 6 + 4  # a round a forward, one a tick's end
