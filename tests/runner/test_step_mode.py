"""runner/step_mode.py: a deterministic runner's call runs in the layers' batch-invariant
mode and leaves it when it returns or raises, so nothing of the mode outlives the call
(layers/kda_invariant.py's pinned fla tuners rely on it); other runners never enter it."""

from __future__ import annotations

import pytest
import torch

from batchgen.layers import batch_invariant
from batchgen.runner.step_mode import profiled, step_mode


class _Runner:
    def __init__(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    @step_mode
    def seen(self) -> tuple[bool, bool]:
        return batch_invariant.active(), torch.is_inference_mode_enabled()

    @step_mode
    def fails(self) -> None:
        assert batch_invariant.active() == self.deterministic
        raise ValueError("a failing step")


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_mode_lasts_as_long_as_the_call(deterministic):
    runner = _Runner(deterministic)
    assert runner.seen() == (deterministic, True)
    assert not batch_invariant.active()
    with pytest.raises(ValueError, match="a failing step"):
        runner.fails()
    assert not batch_invariant.active()
    assert not torch.is_inference_mode_enabled()


def test_a_step_range_is_recorded_while_a_profiler_records_only():
    """`profiled` (the engine's and the runner's step ranges): a profiler's trace names
    the range; with none recording it opens no range (a `record_function` costs a few
    microseconds a step), and the block runs either way."""
    ran = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiled("batchgen.test_range"):
            ran.append(torch.ones(2).sum())
    assert "batchgen.test_range" in {e.name for e in prof.events()}
    with profiled("batchgen.test_range") as opened:
        ran.append(1)
    assert opened is None and len(ran) == 2  # nullcontext's value, not a range's
