"""The engines of a data-parallel job: ShardWorker actors placed one per GPU (one per
CPU on a cluster without GPUs, or with device "cpu"), replaced when they die, killed
at the end.

Invariants:
- A slot holds one live actor at a time; a replacement gets a fresh name, so it never
  waits for the dead actor's name to be released.
- At most `max_restarts` replacements per job; past that a dead slot stays empty.
- Shards go only to engines whose model is loaded (`ready`): a replacement that cannot
  be placed (its node is gone) never holds shards, and one that has not started within
  start_timeout_s counts as dead.
- Every actor this pool created is killed by close(), dead ones included.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from batchgen.api.batch_job import JobOptions
from batchgen.api.shard_worker import ShardWorker

logger = logging.getLogger(__name__)


class DataParallelUsageError(ValueError):
    """The job cannot start: bad options, too few GPUs/CPUs, or no engine could load."""


@dataclass
class DataParallelOptions:
    num_engines: int
    model: str | None = None  # as LLM(model=...): a path every Ray node can read
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    shard_size: int = 64
    max_shard_attempts: int = 3  # runs of one shard that may fail before the job stops
    max_restarts: int | None = None  # engines replaced after a death, in all (None: N)
    start_timeout_s: float = 900.0  # to load the models; the job stops if none has

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.shard_size < 1 or self.max_shard_attempts < 1:
            raise DataParallelUsageError(
                "num_engines, shard_size and max_shard_attempts must be >= 1"
            )
        device = str(self.engine_kwargs.get("device", "auto"))
        if device not in ("auto", "cpu", "cuda"):
            raise DataParallelUsageError(
                f"device must be auto, cpu or cuda under data parallel (Ray gives each "
                f"engine its own GPU), got {device!r}"
            )


class Engine:
    """One slot's current actor and how many of its shard calls are running."""

    def __init__(self, slot: int, handle, ready_ref) -> None:
        self.slot, self.handle, self.ready_ref = slot, handle, ready_ref
        self.alive, self.ready, self.in_flight = True, False, 0
        self.spawned_at = time.monotonic()


class EnginePool:
    def __init__(self, ray, dp: DataParallelOptions, opts: JobOptions, per_engine: int):
        self.ray, self.dp, self.opts, self.per_engine = ray, dp, opts, per_engine
        self.max_restarts = dp.num_engines if dp.max_restarts is None else dp.max_restarts
        self.restarts_left = self.max_restarts
        self.engines: list[Engine] = []
        self.created: list[Engine] = []
        self.job_id = uuid.uuid4().hex[:8]

    def start(self) -> None:
        """Create every engine and wait until they load their models (or fail to)."""
        self.actor_class = self._actor_class()
        self.engines = [self._spawn(slot) for slot in range(self.dp.num_engines)]
        refs = [e.ready_ref for e in self.engines]
        timeout = self.dp.start_timeout_s
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if not ready:
            raise DataParallelUsageError(f"no engine loaded its model within {timeout:g} s")
        failed = []
        for engine in list(self.engines):
            if engine.ready_ref in ready:
                error = self._loaded(engine)
                if error is not None:
                    failed.append((engine, error))
        if not any(e.ready for e in self.engines):
            raise DataParallelUsageError(f"no engine could start: {first_line(failed[0][1])}")
        for engine, error in failed:  # the others run; this one is replaced if it may be
            self.died(engine, error)

    def starting(self) -> list:
        """The ready refs of live engines still loading their model."""
        return [e.ready_ref for e in self.engines if e.alive and not e.ready]

    def on_ready(self, ref) -> None:
        """An engine's ready() returned: it takes shards from now on, or it died."""
        engine = next(e for e in self.created if e.ready_ref == ref)
        error = self._loaded(engine)
        if error is not None:
            self.died(engine, error)

    def _loaded(self, engine: Engine) -> Exception | None:
        try:
            pid = self.ray.get(engine.ready_ref)
        except Exception as e:
            return e
        engine.ready = True
        logger.info("engine %d ready (process %d)", engine.slot, pid)
        return None

    def check_starts(self) -> None:
        """Count an engine that has not started within start_timeout_s as dead."""
        timeout = self.dp.start_timeout_s
        for engine in list(self.engines):
            if engine.alive and not engine.ready:
                if time.monotonic() - engine.spawned_at > timeout:
                    self.died(engine, TimeoutError(f"it did not start within {timeout:g} s"))

    def with_room(self) -> Engine | None:
        """The least busy live engine that may take another shard, if any."""
        live = [e for e in self.engines if e.ready and e.alive and e.in_flight < self.per_engine]
        return min(live, key=lambda e: e.in_flight) if live else None

    def died(self, engine: Engine, error: Exception) -> None:
        """Mark `engine` dead (once; it is killed, if it was alive but broken) and put a
        new one in its slot if restarts are left."""
        if not engine.alive:
            return  # another of its calls already told
        engine.alive = False
        self.ray.kill(engine.handle)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.engines[engine.slot] = self._spawn(engine.slot)
            logger.warning(
                "engine %d failed; its shards go back to the queue and a new engine "
                "takes its place (%d restarts left): %s",
                engine.slot,
                self.restarts_left,
                first_line(error),
            )
        else:
            logger.warning(
                "engine %d failed; its shards go back to the queue (no restarts left): %s",
                engine.slot,
                first_line(error),
            )

    def close(self) -> None:
        for engine in self.created:
            self.ray.kill(engine.handle)

    def _actor_class(self):
        ray, n = self.ray, self.dp.num_engines
        resources = ray.cluster_resources()
        device = str(self.dp.engine_kwargs.get("device", "auto"))
        gpus = device != "cpu" and (device == "cuda" or resources.get("GPU", 0) > 0)
        kind = "GPU" if gpus else "CPU"
        # a tensor-parallel engine runs a process per rank inside its actor, each rank
        # on a GPU (on the CPU: a core) of the actor's own
        tp = int(self.dp.engine_kwargs.get("tensor_parallel_size") or 1)
        if resources.get(kind, 0) < n * tp:
            each = "one each" if tp == 1 else f"{tp} each, tensor_parallel_size={tp}"
            raise DataParallelUsageError(
                f"{n} engines need {n * tp} {kind}s ({each}) but the Ray cluster has "
                f"{resources.get(kind, 0):g}"
            )
        options = dict(num_cpus=1 if gpus else tp, num_gpus=tp if gpus else 0)
        return ray.remote(max_concurrency=self.per_engine + 1, **options)(ShardWorker)

    def _spawn(self, slot: int) -> Engine:
        name = f"batchgen-engine-{self.job_id}-{slot}-{len(self.created)}"
        handle = self.actor_class.options(name=name).remote(
            self.dp.model, self.dp.engine_kwargs, self.opts
        )
        engine = Engine(slot, handle, handle.ready.remote())
        self.created.append(engine)
        return engine


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type; for an error Ray raises on
    behalf of an actor, of the actor's own error (Ray's message opens on a traceback)."""
    error = getattr(error, "cause", None) or error
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
