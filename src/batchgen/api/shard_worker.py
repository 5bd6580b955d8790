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
- After an error in the engine thread (a step, or writing a result) every shard in
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
from batchgen.api.batch_job import JobOptions, prepare_request


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
        self._pending: dict[str, tuple[_ShardRun, bf.Pending]] = {}
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
                runs = {id(r): r for r, _ in self._pending.values()}
                self._pending.clear()
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
            for req in engine.step():
                self._record(req)

    def _admit(self, run: _ShardRun) -> None:
        if self._broken is not None:
            return run.finish(self._broken)
        try:
            self._add(run)
        except Exception as e:  # the run may have no request in the engine to fail it
            run.finish(e)
            raise

    def _add(self, run: _ShardRun) -> None:
        for item in run.shard.items:
            try:
                ids, params = prepare_request(self.llm, item, self.opts)
                self.llm.engine.add_request(str(item.line), ids, params)
            except Exception as e:  # a bad line must never stop the job
                message = str(e) or type(e).__name__
                record = bf.error_line(item.line, item.custom_id, message)
                run.result.errors.append((item.line, bf.dumps(record)))
                continue
            pending = bf.Pending(item.line, item.custom_id, item.url, params.logprobs)
            self._pending[str(item.line)] = (run, pending)
            run.left += 1
        if run.left == 0:
            run.finish()

    def _record(self, req) -> None:
        run, pending = self._pending[req.request_id]  # popped once its line is made
        line = bf.output_line(pending, req, self.opts.model_name, self.llm.tokenizer)
        record = bf.dumps(line)
        del self._pending[req.request_id]
        result = run.result
        result.outputs.append((pending.line, record))
        result.prompt_tokens += len(req.prompt_token_ids)
        result.completion_tokens += len(req.output_token_ids)
        run.left -= 1
        if run.left == 0:
            run.finish()
