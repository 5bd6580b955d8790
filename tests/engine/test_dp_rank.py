"""A data-parallel rank's tick (engine/dp_rank.py) on one process, over a stand-in
engine: an error outside a forward is answered (the tick's lockstep end still runs, so
the other ranks go on), one inside a forward is raised (its collectives may be half
done, so the rank must end)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from batchgen.distributed.lockstep import Lockstep
from batchgen.engine.dp_rank import DPRank
from batchgen.runner.paired import VARIABLE


class _Failing(nn.Module):
    def forward(self, x):
        raise RuntimeError("inside the forward")


class _Engine:
    """What DPRank uses of an EngineCore; step() raises `error`, from inside the
    model's forward where `in_forward` (paired through `lockstep`, as the runner pairs
    a forward it launches)."""

    def __init__(self, error: Exception, in_forward: bool, lockstep: Lockstep) -> None:
        self.model = _Failing() if in_forward else nn.Identity()
        self.error, self.in_forward, self.lockstep = error, in_forward, lockstep
        self.requests: dict = {}
        self.stats = SimpleNamespace(output_tokens=0)
        self.has_unfinished = True

    def step(self):
        if self.in_forward:
            with self.lockstep.forward(VARIABLE):
                self.model(torch.zeros(1))
        raise self.error


def test_an_error_outside_a_forward_is_answered_and_the_tick_ends():
    lockstep = Lockstep(None)
    rank = DPRank(_Engine(ValueError("in the scheduler"), False, lockstep), lockstep)
    result = rank.tick()
    assert isinstance(result.error, ValueError) and str(result.error) == "in the scheduler"
    assert lockstep.rounds == 1  # the tick's end: other ranks' forwards would be paired
    assert result.unfinished


def test_an_error_inside_a_forward_ends_the_rank():
    lockstep = Lockstep(None)
    rank = DPRank(_Engine(ValueError("unused"), True, lockstep), lockstep)
    with pytest.raises(RuntimeError, match="inside the forward"):
        rank.tick()
    assert lockstep.in_forward
