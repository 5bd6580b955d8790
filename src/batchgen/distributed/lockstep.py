"""Forwards in lockstep across the ranks of an attention data-parallel engine.

Each rank runs its own scheduler over its own requests, so in one tick (one step() of
every rank's engine) the ranks may run different numbers of model forwards: none (no
work), one, or two (a pipelined decode's first call queues the step after it too). The
MoE layers' collectives (expert parallel all-to-all) need every rank in every forward,
so each forward is paired across the ranks by a round: an all-reduce (max) of one flag
on the host group, every rank taking part in every round.

    rank A (two forwards this tick)          rank B (none this tick)
    forward 1: round(1) -> 1, runs it         end_tick: round(0) -> 1, dummy forward
    forward 2: round(1) -> 1, runs it                   round(0) -> 1, dummy forward
    end_tick:  round(0) -> 0, tick over                 round(0) -> 0, tick over

A round that any rank enters with 1 makes every rank run one forward (a real one, or a
dummy of one token where it has none); a round every rank enters with 0 ends the tick.
So the ranks run the same number of forwards in every tick, in the same order, and
their MoE collectives pair up whatever each scheduler decided. The rounds go over the
gloo host group: no GPU work, no device synchronisation.

A forward pairs through a pre-hook on the model (`attach`): CUDA-graph replays do not
call the model, so this works for eager forwards only (the DP engine runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from batchgen.distributed.sliced import waited


class Lockstep:
    """One rank's side of the rounds over `group` (a gloo process group; None: one
    rank, every round answered by this rank alone). `rounds` and `dummy_forwards`
    count what this rank ran. check: rank 0's `Workers.check`, where its rounds wait in
    slices of slice_s (sliced.py: a worker's host may vanish silently); None: a plain
    wait (a worker's)."""

    def __init__(
        self, group, check: Callable[[], None] | None = None, slice_s: float = 2.0
    ) -> None:
        self.group, self.check, self.slice_s = group, check, slice_s
        self.rounds = 0
        self.dummy_forwards = 0
        self._pairing = False  # a dummy forward runs: its round is already done
        # a forward began and has not returned: its collectives may be half done, so a
        # failure now cannot be paired away (the rank must end, failing the others fast)
        self.in_forward = False

    def attach(self, model: nn.Module) -> list:
        """Pair every forward of `model` with the other ranks' (a forward pre-hook, and a
        hook that notes its end); the hooks' handles (`.remove()` detaches one)."""
        return [
            model.register_forward_pre_hook(self._before_forward),
            model.register_forward_hook(self._after_forward),
        ]

    def _before_forward(self, module: nn.Module, args) -> None:
        if not self._pairing:
            self._round(True)
        self.in_forward = True

    def _after_forward(self, module: nn.Module, args, output) -> None:
        self.in_forward = False

    def _round(self, forward: bool) -> bool:
        """Whether any rank runs a forward now (this one says whether it does)."""
        self.rounds += 1
        if self.group is None:
            return forward
        flag = torch.tensor([int(forward)], dtype=torch.int32)
        if self.check is None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        else:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            waited(work, self.check, self.slice_s)
        return bool(flag.item())

    def end_tick(self, dummy_forward: Callable[[], None]) -> int:
        """This rank's step is over: run a dummy forward for every forward another rank
        still runs in this tick, until no rank does; the number run."""
        ran = 0
        while self._round(False):
            self._pairing = True
            try:
                dummy_forward()
            finally:
                self._pairing = False
            ran += 1
        self.dummy_forwards += ran
        return ran
