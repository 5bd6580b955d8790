"""A run's batching, replayed: an ample-pool engine computing exactly another run's rows.

The offload probe compares a run whose small device pool forces swaps with a run whose
pool holds everything. The two batch differently (the small pool admits fewer requests
at a time, chunks prompts at other points, and a swapped request recomputes its last
partial page when it comes back), and on a GPU a bf16 GEMM's rounding depends on the
batch's shape: in a random-weight MoE such a difference flips an expert choice and a
row diverges with no tier fault at all (the probe's --control shows as many broken rows
as the tier run). Replaying removes the batching from the comparison:

- `StepRecorder` wraps a (tier) engine's runner and records every step it launches, in
  launch order: each row's (request id, start position, number of tokens).
- `ReplayScheduler` replaces the scheduler of a second engine (ample pool, no tier,
  pipelined decode off: each step is scheduled, run and applied in turn) and makes
  step i compute exactly the rows of recorded step i, in their order: a request first
  seen is admitted, one absent from a step simply waits with its KV where it is (as a
  swapped request's KV waits on host), and a row that starts before what the replay has
  computed (the recomputed partial page of a swap-in, a recompute after preemption)
  recomputes from there over the same positions.

Each step then has the same rows, tokens and shapes in both engines, and only where the
KV lived between steps differs: a correct tier gives identical tokens, bit for bit, on
any device. Stops do not end a replayed request (a pipelined step computes one row more
for a request that stopped on EOS in the step before it, and the replay computes it
too): its rows end where the recording's do, and its tokens are compared over the
recorded run's output.

Limits, raised as ReplayError: a request first admitted past position 0 (a prefix hit
in the recorded run, which the replay's pool, built without prefix caching, has no
copy of), and a rewind in a model with linear-attention state (its slot cannot go
back; hybrid swaps resume at their exact position and never rewind).
"""

from __future__ import annotations

from dataclasses import replace

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.runner.batch import SchedulerOutput

Row = tuple[str, int, int]  # (request id, start, tokens)


class ReplayError(RuntimeError):
    """The recording asks for something a replay cannot reproduce."""


class StepRecorder:
    """Records the rows of every step an engine's runner launches (execute, a queued
    decode step, an async step), in launch order: `steps[i]` is a list of Rows."""

    def __init__(self, engine) -> None:
        self.steps: list[list[Row]] = []
        runner = engine.runner
        for name in ("execute", "launch_decode", "launch_step"):
            setattr(runner, name, self._recording(getattr(runner, name)))

    def _recording(self, launch):
        def recorded(sched: SchedulerOutput, *args, **kwargs):
            rows = [(s.request_id, s.start, len(s.new_token_ids)) for s in sched.requests]
            self.steps.append(rows)
            return launch(sched, *args, **kwargs)

        return recorded


class ReplayScheduler(Scheduler):
    """Schedules recorded steps (see the module docstring). Built over an engine's
    scheduler with `install`; the engine must run steps one at a time (pipeline_decode
    and async scheduling off) and its requests must carry the recorded run's request
    ids, prompts and max_tokens, with ignore_eos and no stops."""

    def __init__(self, base: Scheduler, steps: list[list[Row]]) -> None:
        super().__init__(
            base.kv,
            base.max_num_seqs,
            base.max_num_batched_tokens,
            base.max_model_len,
            list(base.eos_token_ids),
            admission="arrival",
            state_slots=base.state_slots,
        )
        if base.kv.allocator.enable_caching:
            raise ReplayError("the replaying engine must run without prefix caching")
        self.steps = steps
        self.step_index = 0
        self.last_step: dict[str, int] = {}
        for i, rows in enumerate(steps):
            for rid, _, _ in rows:
                self.last_step[rid] = i
        self.by_id: dict[str, Request] = {}

    @classmethod
    def install(cls, engine, steps: list[list[Row]]) -> ReplayScheduler:
        if engine.overlap.name != "plain":
            raise ReplayError("the replaying engine must run with pipeline_decode=False")
        if engine.tier is not None:
            raise ReplayError("the replaying engine must run without the host tier")
        engine.scheduler = cls(engine.scheduler, steps)
        return engine.scheduler

    @property
    def done(self) -> bool:
        return self.step_index >= len(self.steps)

    def add(self, request: Request) -> None:
        if request.request_id not in self.last_step:
            raise ReplayError(f"request {request.request_id!r} has no row in the recording")
        self.by_id[request.request_id] = request
        super().add(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.done:
            return out
        rows = self.steps[self.step_index]
        scheduled: list[tuple[Request, int]] = []
        for rid, start, n in rows:
            req = self.by_id.get(rid)
            if req is None or req.is_finished:
                raise ReplayError(f"step {self.step_index}: request {rid!r} is not running")
            if req.status == RequestStatus.WAITING:
                self._admit(req, start)
            elif start < req.num_computed_tokens:
                if self.state_slots is not None:
                    raise ReplayError(f"request {rid!r}: a linear-attention state cannot rewind")
                req.num_computed_tokens = start  # recompute positions it already has
            if start != req.num_computed_tokens:
                raise ReplayError(
                    f"step {self.step_index}: request {rid!r} starts at {start}, "
                    f"the replay has computed {req.num_computed_tokens}"
                )
            if start + n > req.num_tokens:
                raise ReplayError(
                    f"step {self.step_index}: request {rid!r} has no token {start + n - 1}"
                )
            if not self.kv.allocate(rid, start + n):
                raise ReplayError("the replaying engine's pool is too small")
            scheduled.append((req, n))
        entries = self.feed.entries(scheduled)
        return SchedulerOutput(entries, released_ids=self.take_released())

    def _admit(self, req: Request, start: int) -> None:
        if start:
            raise ReplayError(
                f"request {req.request_id!r} was first admitted at position {start} "
                "(a prefix hit): the replay holds no cached pages"
            )
        self.waiting.remove(req)
        if self.state_slots is not None:
            self.state_slots.take(req.request_id)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def update(self, sched, result, requests):
        advanced = super().update(sched, result, requests)
        step, self.step_index = self.step_index, self.step_index + 1
        for s in sched.requests:
            req = self.by_id[s.request_id]
            if self.last_step[s.request_id] == step and not req.is_finished:
                self.finish(req, "length")  # its rows in the recording end here
        return advanced


def replay_params(params):
    """The recorded run's sampling params for its replay: the same, but no stop ends a
    request (its rows in the recording do)."""
    return replace(params, ignore_eos=True, stop=None, stop_token_ids=[])
