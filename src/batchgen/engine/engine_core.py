"""EngineCore: add / step / abort / reconfigure / metrics over the components builder.py
built and handed over (`EngineParts`). One step loop, schedule -> launch -> the next
step launched while this one runs -> collect -> update, its overlap a policy
(step_loop.py)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from batchgen.config import EngineConfig
from batchgen.engine.builder import EngineParts, replace_pool
from batchgen.engine.builder_load import load_engine
from batchgen.engine.builder_plan import check_pool_size
from batchgen.engine.limits import check_request
from batchgen.engine.memory import weight_bytes
from batchgen.engine.request import Request, RequestStatus
from batchgen.runner.batch import SchedulerOutput
from batchgen.runner.sampler import request_seed
from batchgen.runner.step_mode import profiled
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestsFailed(RuntimeError):
    """A step failed for these requests alone: the engine has dropped them (as abort()
    does) and every other request is intact, its tokens of the step applied; the
    requests the step finished come out of the next step() call."""

    def __init__(self, errors: dict[str, BaseException]) -> None:
        self.errors = errors  # request id -> why it failed
        first = next(iter(errors.values()))
        super().__init__(
            f"request(s) {', '.join(errors)} failed in a step: {type(first).__name__}: {first}"
        )

    @property
    def request_ids(self) -> list[str]:
        return list(self.errors)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0


class EngineCore:
    """Runs one process's steps (tensor parallel: rank 0's) over the model, the page
    pool, the KV manager, the host tier, the scheduler and the runner that
    `builder.build_engine` made: add / step / abort / reconfigure / metrics / shutdown."""

    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config  # its batch limits set for this device and model
        self.model, self.hf_config, self.tokenizer = parts.model, parts.hf_config, parts.tokenizer
        self.device, self.dtype = parts.device, parts.dtype
        self.weight_bytes = weight_bytes(parts.model)  # this rank's, on its device
        self.executor = parts.executor  # the ranks (executor.py): this process is rank 0
        self.plan, self.warmup = parts.plan, parts.warmup
        self.max_model_len = parts.plan.max_model_len
        self.eos_token_ids = parts.plan.eos_token_ids
        self.layout, self.pool = parts.layout, parts.pool
        self.state_pool, self.state_slots = parts.state_pool, parts.state_slots
        self.kv, self.tier, self.tier_cost = parts.kv, parts.tier, parts.tier_cost
        self.checkpoints, self.exact_swap = parts.checkpoints, parts.exact_swap
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.detokenizer = parts.detokenizer
        self._structured = parts.structured  # the runner's too
        self.grammar = None  # _structured, from the first constrained request on
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._arrival = itertools.count()
        self.overlap = parts.overlap  # what runs ahead of the device (step_loop.py)
        self._in_flight = None  # a step launched ahead, collected by the next step()
        self._finished_early: list[Request] = []
        self._failed: dict[str, BaseException] = {}  # in this step: RequestsFailed
        self._num_stop_strings = 0  # requests in the engine with stop strings

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        return cls(load_engine(config))

    def shutdown(self) -> None:
        """Stop the other ranks (tensor parallel's workers; one rank: nothing to stop)."""
        self.executor.shutdown()

    def tier_worker_metrics(self) -> list[dict | None]:
        """Each other rank's host tier mirror counters (rank 1 first; None without the
        tier; one rank: none), once every copy rank 0 submitted has reached and left it."""
        return self.executor.tier_metrics(self.tier)

    def reconfigure(self, num_pages: int) -> None:
        """Free and re-create the device pool with num_pages pages between steps.

        Running requests are preempted first (their KV kept by the tier where it is
        active, else recomputed later); swapped requests and host prefixes survive; the
        device prefix cache starts empty. The old pool is released before the new one
        is allocated; if that allocation fails, a pool of the old size is re-created and
        the error raised, so the engine is never left without one. Under tensor parallel
        every rank re-creates its pool (the same page ids) once the tier copies of the
        preemptions reached it; a rank whose allocation fails sends them all back to the
        old size.
        """
        check_pool_size(self.config, num_pages, self.max_model_len)
        self._drain()
        for req in list(reversed(self.scheduler.running)):
            self.scheduler.running.remove(req)
            self.scheduler.preempt(req)
        if self.tier is not None:
            self.kv.keep_cached_on_host()
            self.kv.take_step_copies()  # nothing may stay queued against the old pool
            self.tier.drain()
        self.pool = None  # freed once the runner and the tier let go of it too
        self.pool, failure, error = replace_pool(
            self.layout, num_pages, self.kv, self.tier, self.runner, self.executor
        )
        if failure:
            raise RuntimeError(
                f"reconfigure({num_pages}) could not allocate the KV pool ({failure}); "
                f"it was re-created with its previous {self.pool.num_pages} pages"
            ) from error

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, what: str) -> None:
        """Raise ValueError naming `what` for a prompt the engine cannot run."""
        check_request(prompt_token_ids, params, self.max_model_len, self.hf_config.vocab_size, what)
        if params.structured_outputs is not None:
            try:
                self._grammar().compile(params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from e

    def _grammar(self):
        """The engine's StructuredOutputs, the runner's too (xgrammar is loaded by its
        first compile); `grammar` from the first constrained request on."""
        if self.grammar is None:
            self.grammar = self._structured
        return self.grammar

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        validated: bool = False,
    ) -> Request:
        """Queue one request. `validated`: the caller has already run validate() on these
        ids and params (LLM checks a whole call's prompts before adding any)."""
        if not validated:
            self.validate(prompt_token_ids, params, f"request {request_id}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = min(params.max_tokens or room, room)
        arrival = next(self._arrival)
        # an unseeded request gets a seed of its own: its draws depend on its arrival
        # index and step only, never on the batch (pipelined or not)
        seed = params.seed if params.seed is not None else request_seed(self.config.seed, arrival)
        req = Request(
            request_id, list(prompt_token_ids), params, max_tokens, arrival=arrival, seed=seed
        )
        if params.structured_outputs is not None:
            self._grammar().add(request_id, params.structured_outputs)
        self.kv.want(request_id, req.token_ids)
        self.requests[request_id] = req
        self.overlap.enter(params)
        self._num_stop_strings += bool(params.stop_strings)
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(prompt_token_ids)
        return req

    def abort(self, request_ids) -> None:
        """Drop unfinished requests (e.g. after a failed step), releasing their pages."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req)
                self.overlap.leave(req.params)
                self._num_stop_strings -= bool(req.params.stop_strings)
            if self.grammar is not None:
                self.grammar.remove(rid)
        queued = self._in_flight
        if queued is not None and not any(
            r.request_id in self.requests for r in queued.sched.requests
        ):
            self._in_flight = None  # nothing left to read from it

    @property
    def has_unfinished(self) -> bool:
        """Whether step() has more to do or to hand out (requests a drained or failed
        step finished wait for the next step())."""
        return (
            self.scheduler.has_unfinished
            or self._in_flight is not None
            or bool(self._finished_early)
        )

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it (and any finished by
        a step drained early, e.g. by reconfigure()).

        With overlap (pipelined decode, async scheduling: step_loop.py) the next step
        is queued on the GPU (its placeholder input tokens read there) before this
        one's tokens reach the host, so the host's bookkeeping overlaps the GPU; a
        request that stops on a token it could not foresee (EOS, a stop string) has its
        queued extra token discarded.

        Raises RequestsFailed when the step failed for some requests only (their
        grammar raised on their token): they are dropped, the rest of the step stands."""
        finished = self._step()
        if self._finished_early:
            finished, self._finished_early = self._finished_early + finished, []
        if self._failed:
            failed, self._failed = self._failed, {}
            self._finished_early = finished  # handed out by the next step()
            self.abort(failed)
            raise RequestsFailed(failed)
        return finished

    def _step(self) -> list[Request]:
        """The one step loop: schedule -> launch -> the next step built and launched
        while this one runs (`overlap.ahead`) -> collect -> update. A step the overlap
        policy does not launch runs synchronously; one launched ahead waits in
        `_in_flight` for the next call, which collects it instead of scheduling."""
        if self.tier is not None:  # finished copies release their pages, pipelined or not
            self.kv.flush_ahead()  # none stays deferred past its step (defer_stores_ahead)
            with profiled("batchgen.tier_poll"):
                self.tier.poll()
        current, self._in_flight = self._in_flight, None
        if current is None:
            with profiled("batchgen.schedule"):
                sched = self.scheduler.schedule()
                copies = self.scheduler.take_copies()
            if sched.is_empty:
                return self._idle(sched)
            current = self.overlap.launch(sched, copies, self.requests)
            if current is None:
                return self._finish_step(sched, self.runner.execute(sched, copies))
            self.kv.flush_ahead()  # the stores ahead schedule() deferred, behind the forward
        self._in_flight = self.overlap.ahead(current, self.requests)
        with profiled("batchgen.wait_tokens"):
            result = current.result()
        finished = self._finish_step(current.sched, result)
        if self._in_flight is not None:  # its masks read the tokens just handed over
            with profiled("batchgen.launch_sample"):
                self._in_flight.launch_sample()
        return finished

    def _idle(self, sched: SchedulerOutput) -> list[Request]:
        """Nothing was scheduled: its released ids wait for the next step that runs;
        the tier's copies in flight are waited for, or nothing is left to schedule."""
        self.scheduler.unsend(sched)
        if self.tier is not None and self.tier.num_in_flight:
            self.tier.drain()
            return []
        if self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("no request could be scheduled with an empty running set")
        return []

    def _drain(self) -> None:
        """Finish a queued decode step now; its finished requests go out with the next
        step()."""
        if self._in_flight is not None:
            current, self._in_flight = self._in_flight, None
            self._finished_early += self._finish_step(current.sched, current.result())

    def _finish_step(self, sched: SchedulerOutput, result) -> list[Request]:
        with profiled("batchgen.update"):  # committed here, or at its launch (async)
            advanced = self.scheduler.update(sched, result, self.requests)
        self.stats.steps += 1
        self.stats.output_tokens += len(advanced)
        if self.grammar is not None:
            self._advance_grammars(advanced)
        finished, done = [], RequestStatus.FINISHED
        if not (self._num_stop_strings or self._failed):  # only a finished row is read
            advanced = [req for req in advanced if req.status is done]
        for req in advanced:
            if req.request_id in self._failed:
                continue  # step() drops it
            if req.finish_reason in (None, "length") and req.params.stop_strings:
                stop = self.detokenizer.find_stop(req)  # a stop string beats the length limit
                if stop is not None:
                    self.scheduler.finish(req, "stop", stop)
            if req.status is done:
                self.detokenizer.finalize(req)
                finished.append(self.requests.pop(req.request_id))
                self.overlap.leave(req.params)
                self._num_stop_strings -= bool(req.params.stop_strings)
                if self.grammar is not None:
                    self.grammar.remove(req.request_id)
        if self.tier is not None and not self.scheduler.has_unfinished:
            self.tier.drain()
        return finished

    def _advance_grammars(self, advanced: list[Request]) -> None:
        """Feed each constrained request's new token to its matcher. A token the grammar
        rejects can only come from another mask forbidding every token it allowed
        (min_tokens holding back the EOS of a complete grammar): the request stops.
        A matcher that raises fails its request alone (step() raises RequestsFailed): one
        call per request, so the others' matchers advance whatever one of them does."""
        rejected = []
        for req in advanced:
            try:
                rejected += self.grammar.advance([req.request_id], [req.output_token_ids[-1]])
            except Exception as e:
                self._failed[req.request_id] = e
        for rid in rejected:
            req = self.requests[rid]
            logger.warning(
                "request %s: its sampled token %d breaks its structured-output "
                "grammar (min_tokens beyond the grammar's end?); it stops here",
                rid,
                req.output_token_ids[-1],
            )
            self.scheduler.finish(req, "stop")

    def metrics(self) -> dict:
        """Counters for summaries: tokens, preemptions, prefix hits and host-tier traffic,
        and the weights' bytes and the device pool's pages (`kv_pages`)."""
        out = {
            "prompt_tokens": self.stats.prompt_tokens,
            "output_tokens": self.stats.output_tokens,
            "steps": self.stats.steps,
            "computed_tokens": self.scheduler.num_computed_tokens_total,
            "prefill_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "preemptions": self.scheduler.num_preemptions,
            "recomputes": self.scheduler.num_recomputes,
            "prefix_hit_tokens": self.kv.prefix_hit_tokens,
            "weight_bytes": self.weight_bytes,
            "kv_pages": self.pool.num_pages,  # the device pool's, after any reconfigure
            **self.executor.step_metrics(),
        }
        if self.checkpoints is not None:
            out["state_checkpoints"] = self.checkpoints.num_stored
            out["state_checkpoint_hit_tokens"] = self.checkpoints.hit_tokens
        if self.tier is not None:
            out.update(self.tier.metrics.summary())
            out.update({f"tier_{k}": v for k, v in self.tier_cost.items()})
        return out
