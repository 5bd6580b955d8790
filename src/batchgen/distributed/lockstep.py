"""Forwards in lockstep across the ranks of an attention data-parallel engine.

Each rank runs its own scheduler over its own requests, so in one tick (one step() of
every rank's engine) the ranks may run different numbers of model forwards: none (no
work), one, or two (a pipelined decode's first call queues the step after it too). The
MoE layers' collectives (expert parallel all-to-all) need every rank in every forward,
so each forward is paired across the ranks by a round: an all-reduce (max) of a mode
and a decode bucket on the host group, every rank taking part in every round. A rank
offers the mode of its forward (runner/paired.py: FIXED 1, a decode step the
fixed-capacity exchange takes; VARIABLE 2, any other), or IDLE 0 once its step is over,
and with FIXED the captured bucket its decode batch needs (else 0):

    rank A (two forwards this tick)          rank B (none this tick)
    forward 1: round(1) -> 1, runs it         end_tick: round(0) -> 1, dummy forward
    forward 2: round(2) -> 2, runs it                   round(0) -> 2, dummy forward
    end_tick:  round(0) -> 0, tick over                 round(0) -> 0, tick over

A round that any rank enters with a forward makes every rank run one (a real one, or a
dummy where it has none) in the agreed mode, the largest offered: under the
fixed-capacity expert-parallel exchange in a FIXED round, sized by the agreed bucket,
the largest offered (`fixed_capacity(bucket)`: every rank's all-to-alls move bucket x
top_k rows a rank pair, a rank with a smaller batch padding to it), the variable one in
a VARIABLE round, whatever each rank offered; a round every rank enters IDLE ends the
tick. So the ranks run the same number of forwards in every tick, in the
same order and mode, and their MoE collectives pair up whatever each scheduler decided.
The rounds go over the gloo host group: no GPU work, no device synchronisation.

The runner pairs each forward where it launches it (runner/paired.py), a decode graph's
replay as well as an eager forward, so the ranks' decode steps may replay CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from batchgen.distributed.sliced import waited
from batchgen.layers.expert_parallel import fixed_capacity
from batchgen.runner.paired import FIXED, IDLE, VARIABLE


class Lockstep:
    """One rank's side of the rounds over `group` (a gloo process group; None: one
    rank, every round answered by this rank alone). What this rank ran: `rounds`,
    `dummy_forwards`, `ran[mode]` (forwards, real or dummy, in FIXED and VARIABLE
    rounds), `fixed_dummies` (dummies in FIXED rounds), `eager_decodes` (forwards
    it offered FIXED that ran VARIABLE beside another rank's step) and `fixed_tokens`
    (the FIXED rounds' agreed buckets summed: the tokens a rank its fixed-capacity
    exchanges were sized for). check: rank 0's `Workers.check`, where its rounds wait in
    slices of slice_s (sliced.py: a worker's host may vanish silently); None: a plain
    wait (a worker's)."""

    def __init__(
        self, group, check: Callable[[], None] | None = None, slice_s: float = 2.0
    ) -> None:
        self.group, self.check, self.slice_s = group, check, slice_s
        self.rounds = 0
        self.dummy_forwards = 0
        self.ran = [0, 0, 0]  # by the round's mode (IDLE's stays 0)
        self.fixed_dummies = 0
        self.eager_decodes = 0
        self.fixed_tokens = 0
        # a forward began and has not returned: its collectives may be half done, so a
        # failure now cannot be paired away (the rank must end, failing the others fast)
        self.in_forward = False

    @contextmanager
    def forward(self, mode: int, bucket: int = 0) -> Iterator[tuple[int, int]]:
        """One forward of this rank's, offered in `mode` (FIXED or VARIABLE) and, where
        FIXED, its decode `bucket`: the round, then the agreed (mode, bucket), inside
        which the forward runs (under the fixed-capacity exchange of that bucket where
        FIXED). in_forward while inside; left set where the forward raises."""
        agreed, largest = self._round(mode, bucket)
        self.eager_decodes += mode == FIXED and agreed == VARIABLE
        with self._running(agreed, largest):
            yield agreed, largest

    @contextmanager
    def _running(self, mode: int, bucket: int) -> Iterator[None]:
        self.ran[mode] += 1
        self.in_forward = True
        if mode == FIXED:
            self.fixed_tokens += bucket
        with fixed_capacity(bucket) if mode == FIXED else nullcontext():
            yield
        self.in_forward = False

    def _round(self, mode: int, bucket: int = 0) -> tuple[int, int]:
        """The largest mode and bucket any rank offers now (this one offers `mode`,
        `bucket`)."""
        self.rounds += 1
        if self.group is None:
            return mode, bucket
        flag = torch.tensor([mode, bucket], dtype=torch.int32)
        if self.check is None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        else:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            waited(work, self.check, self.slice_s)
        mode, bucket = flag.tolist()
        return mode, bucket

    def end_tick(self, dummy_forward: Callable[[int, int], None]) -> int:
        """This rank's step is over: run dummy_forward(mode, bucket) for every forward
        another rank still runs in this tick, in that round's mode and bucket, until no
        rank does; the number run."""
        ran = 0
        while True:
            mode, bucket = self._round(IDLE)
            if mode == IDLE:
                break
            with self._running(mode, bucket):
                dummy_forward(mode, bucket)
            self.fixed_dummies += mode == FIXED
            ran += 1
        self.dummy_forwards += ran
        return ran
