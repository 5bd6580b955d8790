"""Lockstep (distributed/lockstep.py) on spawned gloo ranks: ranks that run different
numbers of forwards in a tick (none, one, two) still meet in every forward's collective,
the ones with fewer running dummy forwards, and leave each tick together."""

from __future__ import annotations

import torch
from torch import nn
from tp_workers import run_ranks

from batchgen.distributed.lockstep import Lockstep
from batchgen.layers import expert_parallel
from batchgen.layers.tp_group import TPGroup
from batchgen.runner.paired import FIXED, IDLE, VARIABLE


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
    dummies = []
    for count in plan[tp.rank]:
        for _ in range(count):
            with lockstep.forward(VARIABLE):  # as the runner pairs a forward it launches
                model(torch.tensor([10.0**tp.rank]))
        dummies.append(lockstep.end_tick(lambda mode, bucket: model(torch.zeros(1))))
    return {"seen": model.seen, "dummies": dummies, "rounds": lockstep.rounds}


def test_ranks_with_different_forward_counts_pair_every_forward(tmp_path):
    plan = [[2, 0, 1, 1], [1, 1, 0, 2]]  # a pipelined start, an idle rank, both busy
    rank0, rank1 = run_ranks(_ticks, 2, tmp_path, plan)
    # both real (11), then rank 0 real beside rank 1's dummy (1); rank 1 alone (10);
    # rank 0 alone (1); both (11), then rank 1 alone (10)
    assert rank0["seen"] == rank1["seen"] == [11.0, 1.0, 10.0, 1.0, 11.0, 10.0]
    assert rank0["dummies"] == [0, 1, 0, 1] and rank1["dummies"] == [1, 0, 1, 0]
    assert rank0["rounds"] == rank1["rounds"] == 6 + 4  # a round a forward, one a tick's end


def _modes(tp: TPGroup, plan: list[list[list[int]]]) -> dict:
    """Tick t: rank r offers the modes plan[t][r] (FIXED or VARIABLE), one forward each,
    then ends the tick; each forward (real or dummy) records the round's mode and
    whether it ran under the fixed-capacity exchange."""
    lockstep = Lockstep(tp.host_group)
    seen = []
    for tick in plan:
        for offer in tick[tp.rank]:
            with lockstep.forward(offer, 1 if offer == FIXED else 0) as (mode, _):
                seen.append(("real", offer, mode, fixed_now()))
        lockstep.end_tick(lambda mode, _: seen.append(("dummy", IDLE, mode, fixed_now())))
    counts = dict(ran=lockstep.ran, fixed_dummies=lockstep.fixed_dummies)
    return dict(seen=seen, eager_decodes=lockstep.eager_decodes, **counts)


def fixed_now() -> bool:
    """Whether expert-parallel layers would dispatch with fixed capacity here."""
    return expert_parallel._FIXED.get()


def test_every_rank_runs_each_forward_in_the_largest_offered_mode(tmp_path):
    """One rank decodes (FIXED) while another prefills (VARIABLE) and a third is idle:
    all three run that forward VARIABLE, the decode eagerly beside the prefill. Then two
    decode and one idles: all three run FIXED, the idle one's dummy under the
    fixed-capacity exchange too."""
    F, V = FIXED, VARIABLE
    plan = [[[F], [V], []], [[F, F], [F], []], [[V], [], [F]]]
    ranks = run_ranks(_modes, 3, tmp_path, plan)
    agreed = [[mode for _, _, mode, _ in r["seen"]] for r in ranks]
    assert agreed[0] == agreed[1] == agreed[2] == [V, F, F, V]
    for r in ranks:  # under the fixed-capacity exchange exactly in FIXED rounds
        assert [fixed for _, _, _, fixed in r["seen"]] == [False, True, True, False]
    assert [r["seen"][0][:3] for r in ranks] == [
        ("real", F, V),
        ("real", V, V),
        ("dummy", IDLE, V),
    ]
    assert [r["eager_decodes"] for r in ranks] == [1, 0, 1]  # rank 2's last: rank 0's V
    assert [r["fixed_dummies"] for r in ranks] == [0, 1, 2]
    assert [r["ran"] for r in ranks] == [[0, 2, 2]] * 3


def _buckets(tp: TPGroup, plan: list[list[int]]) -> dict:
    """Round t: rank r offers a FIXED decode of bucket plan[t][r] (0: none, it ends the
    tick); each forward records the round's bucket and the capacity expert-parallel
    layers would size their exchange by."""
    lockstep = Lockstep(tp.host_group)
    seen = []
    for tick in plan:
        if tick[tp.rank]:
            with lockstep.forward(FIXED, tick[tp.rank]) as (mode, bucket):
                seen.append((mode, bucket, capacity_now()))
        lockstep.end_tick(lambda mode, bucket: seen.append((mode, bucket, capacity_now())))
    return dict(seen=seen, fixed_tokens=lockstep.fixed_tokens)


def capacity_now() -> int | None:
    """Local tokens' fixed capacity expert-parallel layers would dispatch with here."""
    return expert_parallel._CAPACITY.get()


def test_a_fixed_round_sizes_every_ranks_exchange_by_the_largest_bucket(tmp_path):
    """Ranks offering decode buckets 2, 8 and 4 (then 16 beside an idle rank, then 1
    alone): each rank, the idle one too, runs the round under the fixed-capacity
    exchange of the largest, not its own; outside a round no capacity is set."""
    plan = [[2, 8, 4], [16, 0, 4], [0, 1, 0]]
    ranks = run_ranks(_buckets, 3, tmp_path, plan)
    for r in ranks:
        assert r["seen"] == [(FIXED, 8, 8), (FIXED, 16, 16), (FIXED, 1, 1)]
        assert r["fixed_tokens"] == 8 + 16 + 1
    assert capacity_now() is None
