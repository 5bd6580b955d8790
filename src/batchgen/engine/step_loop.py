"""How far the host runs ahead of the device: the overlap policy of the engine's one step
loop (EngineCore._step), chosen by the builder from `EnginePlan.overlap`.

    schedule N -> launch N -> build and launch N+1 while N runs -> collect N -> update N
                  (policy.launch)  (policy.ahead)                 (result)

    plain      launches nothing: N runs synchronously (runner.execute), nothing ahead.
    pipelined  launches a decode step (runner.launch_decode), and with launch_steps any
               step (runner.launch_step: one that admits requests); ahead, the next
               decode step built blind (pipeline.next_decode: input tokens read on the
               device).
    async      launches any step (runner.launch_step) and commits it (Scheduler.commit);
               ahead, the scheduler's next step, committed at its launch too.

A policy holds the runner, the scheduler and the KV manager it was built with, and looks
their methods up at each call; the engine hands it its requests. A launched step is an
`runner.in_flight.InFlightDecode`; the one launched ahead waits in the engine as
`_in_flight` until the next step() collects it. Whether a step was committed at its
launch is the scheduler's to know: the engine updates every step the same way
(`Scheduler.update` applies a committed step, commits and applies any other).
"""

from __future__ import annotations

from batchgen.engine.pipeline import could_admit, ending_by_length, next_decode, seats_wait
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.runner.batch import SchedulerOutput, StepCopies
from batchgen.runner.in_flight import InFlightDecode
from batchgen.runner.model_runner import ModelRunner
from batchgen.runner.step_mode import profiled
from batchgen.sampling_params import SamplingParams


class Overlap:
    """The policy's interface; this base class itself is plain stepping: it launches
    nothing (every step runs synchronously) and builds nothing ahead."""

    name = "plain"

    def launch(
        self,
        sched: SchedulerOutput,
        copies: StepCopies,
        requests: dict[str, Request],
        prev: InFlightDecode | None = None,
    ) -> InFlightDecode | None:
        """Queue `sched` (after `prev`, whose samples are its placeholders' tokens) without
        waiting for it; None: this policy does not take it, it runs synchronously."""
        return None

    def ahead(self, current: InFlightDecode, requests: dict[str, Request]) -> InFlightDecode | None:
        """Build and launch the step after `current` while it runs; None: none now."""
        return None

    def enter(self, params: SamplingParams) -> None:
        """A request with these parameters came into the engine."""

    def leave(self, params: SamplingParams) -> None:
        """A request with these parameters left the engine (finished or aborted)."""


class Pipelined(Overlap):
    """Pipelined decode: a decode step is queued (`launch_decode`), and before its tokens
    reach the host the next decode step, built blind by `pipeline.next_decode`, is queued
    behind it. With `launch_steps` (one rank, no host tier) a step that prefills (one
    that admits requests) is queued too (`launch_step`), so the decode step after it is
    built and queued while it runs, not scheduled once its tokens are back; as after a
    decode step, a seat that a stop in it frees (EOS, a stop string) is taken one step
    later. Steps the runner cannot launch (debug, a per-layer append, while a request
    needs each step on the host: `needs_sync`) run synchronously; a blind step it cannot
    launch is given back (`Scheduler.unsend`)."""

    name = "pipelined"

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        kv: KVCacheManager,
        launch_steps: bool = False,
    ) -> None:
        self.runner, self.scheduler, self.kv = runner, scheduler, kv
        self.launch_steps = launch_steps
        self.num_sync = 0  # requests in the engine that keep prefill steps synchronous

    def launch(self, sched, copies, requests, prev=None):
        runner = self.runner
        if runner.can_launch_decode(sched, copies):
            return runner.launch_decode(sched, prev, copies)
        if (
            not self.launch_steps
            or self.num_sync
            or prev is not None
            or runner.debug
            or copies.on_kv_written is not None
        ):
            return None
        return runner.launch_step(sched, None, copies)

    def ahead(self, current, requests):
        queued, scheduler = current.sched, self.scheduler
        with profiled("batchgen.next_decode"):
            admit = not seats_wait(queued, scheduler)
            following = next_decode(queued, scheduler, self.kv, requests, admit)
        if following is None:
            return self._admit_ahead(current, requests)
        step, copies = following
        if not self.runner.can_launch_decode(step, copies):
            self.scheduler.unsend(step)
            return None
        with profiled("batchgen.launch"):  # `launch`, its check (a pass over the rows) made
            return self.runner.launch_decode(step, current, copies)

    def _admit_ahead(self, current: InFlightDecode, requests) -> InFlightDecode | None:
        """The step after `current` where a waiting request can be admitted: scheduled
        and launched while `current` runs, as `Async` does (`current` committed first,
        its tokens placeholders the runner reads on the device), instead of scheduled
        once `current`'s tokens are applied, with the device idle meanwhile. The new
        step is committed only if the one after it is scheduled ahead too; else its
        update counts it as a blind step's. A request whose token from `current` is its
        last by length leaves the running set first (`Scheduler.retire`), so its seat
        goes to a waiting request in this step, as a schedule after `current` would
        give it. None where this policy launches decode steps only, a step must run
        synchronously (a request that `needs_sync`, debug), nothing can be admitted, or
        a hybrid model's request ends by length (its state slot is freed as its token
        is applied)."""
        scheduler, runner = self.scheduler, self.runner
        if not self.launch_steps or self.num_sync or runner.debug or not scheduler.waiting:
            return None
        ending = ending_by_length(current.sched, scheduler, requests)
        if ending and scheduler.hybrid is not None:
            return None
        for req in ending:
            scheduler.retire(req)
        if not could_admit(scheduler, self.kv):
            return None
        if not scheduler.is_committed(current.sched):
            scheduler.commit(current.sched, requests)
        with profiled("batchgen.schedule_ahead"):
            step = scheduler.schedule()
            copies = scheduler.take_copies()
        if step.is_empty or copies.on_kv_written is not None:
            scheduler.unsend(step)  # what it admitted is scheduled by the next schedule()
            return None
        with profiled("batchgen.launch"):
            return runner.launch_step(step, current, copies)

    def enter(self, params: SamplingParams) -> None:
        self.num_sync += needs_sync(params)

    def leave(self, params: SamplingParams) -> None:
        self.num_sync -= needs_sync(params)


class Async(Overlap):
    """Async scheduling: any step is launched (`launch_step`) and committed at once
    (`Scheduler.commit`); while it runs, `schedule()` builds the next (a token still in
    flight is a placeholder the runner fills on the device), launched before the first
    one's tokens are read. A request that needs each step's tokens on the host first
    (structured output) or prompt logprobs (`needs_sync`) makes steps synchronous while it
    is in the engine. The schedule can differ from plain stepping's: a request finishing
    in the step in flight still holds its seat and pages when the next one is scheduled."""

    name = "async"

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.num_sync = 0  # requests in the engine for which steps run synchronously

    def launch(self, sched, copies, requests, prev=None):
        if self.num_sync:
            return None
        flight = self.runner.launch_step(sched, prev, copies)
        self.scheduler.commit(sched, requests)
        return flight

    def ahead(self, current, requests):
        if self.num_sync:
            return None
        with profiled("batchgen.schedule_ahead"):
            following = self.scheduler.schedule()
            copies = self.scheduler.take_copies()
        if following.is_empty:
            self.scheduler.unsend(following)
            return None
        with profiled("batchgen.launch"):
            return self.launch(following, copies, requests, current)

    def enter(self, params: SamplingParams) -> None:
        self.num_sync += needs_sync(params)

    def leave(self, params: SamplingParams) -> None:
        self.num_sync -= needs_sync(params)


def build_overlap(
    mode: str,
    runner: ModelRunner,
    scheduler: Scheduler,
    kv: KVCacheManager,
    launch_steps: bool = False,
) -> Overlap:
    """The policy for `EnginePlan.overlap` ("plain", "pipelined" or "async");
    `launch_steps`: pipelined also launches steps that prefill (the builder's choice: one
    rank, as a tensor-parallel runner launches decode steps only, and no host tier)."""
    if mode == "async":
        return Async(runner, scheduler)
    if mode == "pipelined":
        return Pipelined(runner, scheduler, kv, launch_steps)
    if mode == "plain":
        return Overlap()
    raise ValueError(f"unknown overlap mode {mode!r}")


def needs_sync(params: SamplingParams) -> bool:
    """A request whose every step needs the previous step's tokens on the host (or
    reports what only a plain step computes): async scheduling runs steps synchronously
    for it. Penalties and logprobs do not: the runner keeps penalty counts on the device
    and copies logprobs to the host with the tokens."""
    return params.structured_outputs is not None or params.prompt_logprobs is not None
