"""One engine of a data-parallel job: runs shards of batch lines and returns their
output and error lines, written by nobody but the driver.

    driver ──run_shard(Shard)──> ShardWorker (a Ray actor; one call per shard, several
       ^                           │          calls waiting at once, one thread each)
       │                           v
       │                         inbox ──> engine thread: admits every waiting shard's
       │                                   requests and steps the one engine, so shards
       └──── ShardResult <─────────────── share its batch; a shard's call returns when
                                           its last request finishes

Invariants:
- Only the engine thread touches the engine; calls meet it through the inbox.
- A ShardResult holds one record per item of its shard: an output line, or an error
  record for an item the engine refused; each list is sorted by input line.
- A step that fails for some requests only (engine_core.RequestsFailed) gives their
  lines error records and the rest go on.
- After any other error in the engine thread (a step, or writing a result) every shard in
  flight, and every later one, fails with it; the driver replaces the worker and runs
  the shards elsewhere. The worker never returns a partial shard, and its calls never
  wait on a dead thread.

This module does not import Ray: the driver wraps ShardWorker with ray.remote.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo
from batchgen.api.batch_job import JobOptions, error_record
from batchgen.api.batch_requests import InFlight, prepare_line
from batchgen.engine.engine_core import RequestsFailed


@dataclass
class Shard:
    """Consecutive input lines still to run (lines answered earlier are left out)."""

    index: int  # position in the input: shards are written in this order
    items: list[bf.BatchItem]
    attempts: int = 0  # failed runs so far (a dead actor or an engine error)


@dataclass
class ShardResult:
    index: int
    outputs: list[tuple[int, bytes]] = field(default_factory=list)  # (input line, JSONL)
    errors: list[tuple[int, bytes]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _ShardRun:
    """A shard inside the worker: its result so far and how many requests are left."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.result = ShardResult(shard.index)
        self.left = 0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.result.outputs.sort()
        self.result.errors.sort()
        self.done.set()


class ShardWorker:
    """An LLM and the thread that steps its engine over every shard given to it."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], opts: JobOptions):
        from batchgen.api.llm import LLM

        self.llm = LLM(model=model, **engine_kwargs)
        self.opts = opts
        self._inbox: queue.SimpleQueue[_ShardRun] = queue.SimpleQueue()
        self._flight = InFlight(self.llm.engine)
        self._runs: dict[int, _ShardRun] = {}  # input line in flight -> its shard's run
        self._broken: BaseException | None = None
        threading.Thread(target=self._loop, name="batchgen-engine", daemon=True).start()

    def ready(self) -> int:
        """The worker's process id, once its model is loaded."""
        return os.getpid()

    def run_shard(self, shard: Shard) -> ShardResult:
        """Run every item of `shard`; blocks this call's thread until the last finishes."""
        run = _ShardRun(shard)
        self._inbox.put(run)
        run.done.wait()
        if run.error is not None:
            raise run.error
        return run.result

    def _loop(self) -> None:
        while True:
            try:
                self._step()
            except Exception as e:  # the engine's state is unknown: fail all, run no more
                self._broken = e
                runs = {id(r): r for r in self._runs.values()}
                self._runs.clear()
                for r in runs.values():
                    r.finish(e)

    def _step(self) -> None:
        """Admit every shard waiting in the inbox (block when idle), then one step."""
        engine = self.llm.engine
        idle = self._broken is not None or not engine.has_unfinished
        run = self._inbox.get() if idle else None
        while True:
            if run is not None:
                self._admit(run)
            try:
                run = self._inbox.get_nowait()
            except queue.Empty:
                break
        if self._broken is None and engine.has_unfinished:
            try:
                finished = engine.step()
            except RequestsFailed as e:
                for rid, error in e.errors.items():
                    self._fail(rid, error)
                return
            for req in finished:
                pending = self._flight.finished(req)
                if pending is not None:
                    self._record(pending)

    def _admit(self, run: _ShardRun) -> None:
        if self._broken is not None:
            return run.finish(self._broken)
        try:
            self._add(run)
        except Exception as e:  # the run may have no request in the engine to fail it
            run.finish(e)
            raise

    def _add(self, run: _ShardRun) -> None:
        opts = self.opts
        for item in run.shard.items:
            try:
                ids, params, children = prepare_line(self.llm, item, opts.defaults, opts.seed)
                self._flight.add(item, ids, params, children)
            except Exception as e:  # a bad line must never stop the job
                self._error(run, item.line, item.custom_id, item.digest, str(e))
                continue
            self._runs[item.line] = run
            run.left += 1
        if run.left == 0:
            run.finish()

    def _fail(self, rid: str, error: BaseException) -> None:
        """A line whose request a step failed for: its record, the rest of it dropped."""
        pending = self._flight.pending_of(rid)
        if pending is None:
            return
        self._flight.drop(pending)
        run = self._runs.pop(pending.line)
        message = f"the request failed inside the engine: {error}"
        self._error(run, pending.line, pending.custom_id, pending.digest, message, "engine_error")
        run.left -= 1
        if run.left == 0:
            run.finish()

    @staticmethod
    def _error(run: _ShardRun, line: int, cid, digest, message: str, code="invalid_request"):
        error = bf.LineError(message or "error", cid)
        error.digest = digest
        run.result.errors.append((line, error_record(line, error, code)))

    def _record(self, pending: bo.Pending) -> None:
        record = bo.dumps(bo.output_line(pending, self.opts.model_name, self.llm.tokenizer))
        run = self._runs.pop(pending.line)  # popped once its line is made
        result = run.result
        result.outputs.append((pending.line, record))
        n_in, n_out = pending.usage
        result.prompt_tokens += n_in
        result.completion_tokens += n_out
        run.left -= 1
        if run.left == 0:
            run.finish()
