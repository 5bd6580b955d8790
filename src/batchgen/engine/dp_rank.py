"""One rank of an attention data-parallel engine (dp_attention.py): a whole engine of
its own (EngineCore: scheduler, KV manager, page pool, state slots, host tier) over the
requests rank 0 gave it, whose forwards run in lockstep with the other ranks'
(distributed.lockstep; its runner pairs each one where it launches it, runner/paired.py),
because the MoE layers' collectives need every rank.

Rank 0 runs one beside its coordinator; ranks 1..D-1 run `worker_main` in the
processes distributed.workers spawns, acting on DPStep and DPQuery messages until
Shutdown.
"""

from __future__ import annotations

import copy
import logging
import pickle
from dataclasses import dataclass, field

from batchgen.config import EngineConfig
from batchgen.distributed.lockstep import Lockstep
from batchgen.distributed.messages import DPMessage, DPQuery, DPRequest, DPStep
from batchgen.distributed.worker_rank import receive_scattered, serve
from batchgen.engine.builder_load import load_engine
from batchgen.engine.engine_core import EngineCore, RequestsFailed
from batchgen.engine.request import Request
from batchgen.layers.tp_group import TPGroup
from batchgen.runner.paired import FIXED, VARIABLE, idle_replay

logger = logging.getLogger(__name__)


@dataclass
class TickResult:
    """What one rank's tick did: the requests it finished (detached from the engine:
    plain data), those that failed (request id -> what failed), the error its step
    raised, whether it has more to do, and its output tokens so far."""

    finished: list[Request] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    error: BaseException | None = None  # the step raised (outside a forward)
    unfinished: bool = False
    output_tokens: int = 0


class DPRank:
    """A rank's engine and its side of the lockstep rounds (`lockstep`: the one its
    runner pairs each forward through, load_engine's `pairing`). `tick` runs one step of
    the engine (none where it holds nothing), then pairs every forward the other ranks
    still run with a dummy one in the round's mode (`_dummy_forward`)."""

    def __init__(self, engine: EngineCore, lockstep: Lockstep) -> None:
        self.engine = engine
        self.lockstep = lockstep

    def add(self, new: list[DPRequest]) -> None:
        for item in new:
            self.engine.add_request(
                item.request_id, item.prompt_token_ids, item.params, validated=True
            )

    def tick(self, aborts=(), new=()) -> TickResult:
        """Add `new`, drop `aborts` this rank holds, run one step, then the lockstep's
        end. An error outside a forward is paired away (the other ranks' forwards get
        dummies) and answered as `error`, so rank 0 raises it naming this rank; one
        inside a forward, whose collectives may be half done, is raised: the rank ends
        and the others fail at once."""
        engine = self.engine
        result = TickResult()
        try:
            self.add(new)
            held = [rid for rid in aborts if rid in engine.requests]
            if held:
                engine.abort(held)
            if engine.has_unfinished:
                try:
                    result.finished = [_detached(req) for req in engine.step()]
                except RequestsFailed as e:
                    result.failed = {rid: f"{type(x).__name__}: {x}" for rid, x in e.errors.items()}
        except Exception as e:
            if self.lockstep.in_forward:
                raise
            result.error = e
        self.lockstep.end_tick(self._dummy_forward)
        result.unfinished = engine.has_unfinished
        result.output_tokens = engine.stats.output_tokens
        return result

    def _dummy_forward(self, mode: int, bucket: int) -> None:
        """In a FIXED round where the runner has decode graphs, the round's bucket
        replayed with padding alone (paired.idle_replay: the bucket's fixed-capacity
        exchange is captured in it); else one token in a throw-away pool
        (`EngineCore.warmup.forward`), which the lockstep runs under the round's
        exchange (FIXED: `bucket`'s capacity)."""
        runner = self.engine.runner
        if mode == FIXED and runner.graphs is not None:
            idle_replay(runner, bucket)
        else:
            self.engine.warmup.forward(1, max_len=1)

    def metrics(self) -> dict:
        """The engine's metrics and what this rank ran in the lockstep rounds:
        `dp_dummy_forwards` (forwards only to pair another rank's; `dp_fixed_dummies`
        of them in FIXED rounds), `dp_fixed_forwards` and `dp_variable_forwards` (real
        or dummy, by the round's mode: runner/paired.py) and `dp_eager_decodes`
        (decode steps offered FIXED, run eagerly beside another rank's VARIABLE step),
        `dp_fixed_tokens` (the FIXED rounds' agreed decode buckets summed: the tokens a
        rank their fixed-capacity exchanges were sized for)."""
        lockstep = self.lockstep
        return {
            **self.engine.metrics(),
            "dp_dummy_forwards": lockstep.dummy_forwards,
            "dp_fixed_dummies": lockstep.fixed_dummies,
            "dp_fixed_forwards": lockstep.ran[FIXED],
            "dp_variable_forwards": lockstep.ran[VARIABLE],
            "dp_eager_decodes": lockstep.eager_decodes,
            "dp_fixed_tokens": lockstep.fixed_tokens,
        }

    def slots(self) -> dict[str, int]:
        """Request id -> the state slot it holds (models with linear-attention layers;
        empty otherwise)."""
        held = self.engine.state_slots
        if held is None:
            return {}
        return {rid: held.slot(rid) for rid in self.engine.requests if held.holds(rid)}

    def pages(self) -> dict[str, int]:
        """Request id -> the device pages it holds, for each request holding any."""
        return {rid: len(pages) for rid, pages in self.engine.kv.pages.items() if pages}


def _picklable(error: BaseException) -> BaseException:
    """The error itself where it pickles, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _detached(req: Request) -> Request:
    """A finished request as plain data, for rank 0 (its incremental detokenizer, a
    tokenizers object, stays here)."""
    out = copy.copy(req)
    out.detok_stream = None
    return out


def worker_main(tp: TPGroup, config: EngineConfig) -> None:
    """Rank r's life once it joined the group: build its engine, as rank 0 does, then
    serve rank 0's messages until Shutdown."""
    lockstep = Lockstep(tp.host_group)
    engine = EngineCore(load_engine(config, pairing=lockstep))
    try:
        serve(tp, _Worker(DPRank(engine, lockstep), tp).handle)
    finally:
        engine.shutdown()


class _Worker:
    """A worker rank's side: one handler a message type (tests check every DPMessage
    type has one)."""

    HANDLERS = {DPStep: "_step", DPQuery: "_query"}

    def __init__(self, rank: DPRank, tp: TPGroup) -> None:
        self.rank = rank
        self.tp = tp
        self.index = tp.rank

    def handle(self, message: DPMessage):
        name = self.HANDLERS.get(type(message))
        if name is None:
            raise TypeError(
                f"data-parallel rank {self.index}: no handler for a {type(message).__name__} "
                f"message ({message!r:.200})"
            )
        return getattr(self, name)(message)

    def _step(self, message: DPStep) -> TickResult:
        new = receive_scattered(self.tp) if message.new else []
        result = self.rank.tick(message.aborts, new)
        if result.error is not None:  # rank 0 raises it; its traceback is logged here
            logger.error("data-parallel rank %d: a step failed", self.index, exc_info=result.error)
            result.error = _picklable(result.error)
        return result

    def _query(self, message: DPQuery):
        if message.what == "metrics":
            return self.rank.metrics()
        if message.what == "pages":
            return self.rank.pages()
        if message.what == "slots":
            return self.rank.slots()
        if message.what == "statuses":
            return {rid: req.status for rid, req in self.rank.engine.requests.items()}
        raise ValueError(f"DPQuery: unknown {message.what!r} (metrics, pages, slots, statuses)")
