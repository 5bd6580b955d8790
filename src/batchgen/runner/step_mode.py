"""The mode a runner's entry points run the model in."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

import torch
from torch.profiler import record_function

from batchgen.layers.batch_invariant import invariant_mode

F = TypeVar("F", bound=Callable)


def step_mode(method: F) -> F:
    """A runner method run under torch.inference_mode() and, where its runner is
    `deterministic`, the layers' batch-invariant mode (layers/batch_invariant.py): every
    forward, logits GEMM, CUDA graph capture and sampling a step queues."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch.inference_mode(), invariant_mode(self.deterministic):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def profiled(name: str):
    """A profiler range around a phase of the step, only while a profiler records: the
    hot loop pays one check otherwise, where `record_function` enters and leaves a
    range (two dispatcher calls, a few microseconds) on every step."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()
