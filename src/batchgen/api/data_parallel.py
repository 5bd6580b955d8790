"""Data parallel: N engines as Ray actors over one batch file, one resumable output.

    input ──read──> Answers: lines answered earlier skipped, bad lines -> error records
      │                │ lines to run, cut into shards of shard_size consecutive lines
      │                v
      │          queue of shards ──> whichever engine has room takes the next one
      │                                (ShardWorker actors; a dead one's shards go back
      │                                 to the front of the queue)
      │                                     │ ShardResult: output + error lines
      v                                     v
    the driver alone writes OUTPUT and OUTPUT.errors.jsonl (Appender), shard by shard
    in input order; a shard that finishes early waits in a bounded buffer

Invariants:
- Only the driver appends, with the journal's Appender, so the single-engine guarantees
  hold: whole lines, append-only, synced every sync_every_s, a rerun skips what is
  written and repairs a torn last line; the caller holds OutputLock.
- Shards are written in input order and each shard's lines in input order, so a run
  appends its lines in input order; as a rerun starts after what earlier runs wrote, an
  output written only by data-parallel runs is in input order across kills and reruns.
- At most `window` shards are read and not yet written: memory holds at most that many
  shards' requests and results, never the input.
- A shard whose run fails (its actor died, or its engine raised: the actor is replaced)
  goes back to the queue;
  after max_shard_attempts failures, or with no engine left, the job stops with
  DataParallelError after writing every shard it can in order: a rerun resumes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from batchgen.api.batch_job import (
    Answers,
    JobOptions,
    JobSummary,
    Signals,
    error_record,
    progress_bar,
)
from batchgen.api.batch_journal import (
    Appender,
    check_input,
    errors_path,
    read_lines,
    record_input,
)
from batchgen.api.engine_pool import (
    DataParallelOptions,
    DataParallelUsageError,
    Engine,
    EnginePool,
    first_line,
)
from batchgen.api.shard_worker import Shard, ShardResult

__all__ = [  # the options and the usage error live in engine_pool, which reads them
    "DataParallelError",
    "DataParallelOptions",
    "DataParallelUsageError",
    "RayNotInstalled",
    "import_ray",
    "run_data_parallel",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = "data parallel runs on Ray, which is not installed: pip install 'batchgen[ray]'"


class RayNotInstalled(ImportError):
    """`ray` cannot be imported; the message says how to install it."""


class DataParallelError(RuntimeError):
    """Engines failed again and again; what was written is intact and a rerun resumes."""


def import_ray():
    """The ray module, or RayNotInstalled saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RayNotInstalled(INSTALL_HINT) from e
    return ray


def run_data_parallel(opts: JobOptions, dp: DataParallelOptions) -> JobSummary:
    """Run every unanswered line of opts.input on dp.num_engines Ray actors; see the
    module docstring. Joins the Ray session already initialized in this process, or
    starts a local one (ray.init(), which honours RAY_ADDRESS) and shuts it down after."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        return _Job(ray, opts, dp).run()
    finally:
        if started:
            ray.shutdown()


class _Job:
    def __init__(self, ray, opts: JobOptions, dp: DataParallelOptions) -> None:
        self.ray, self.opts, self.dp = ray, opts, dp
        self.per_engine = max(1, -(-opts.max_in_flight // dp.shard_size))
        self.window = 2 * dp.num_engines * self.per_engine
        self.summary = JobSummary()
        self.queue: deque[Shard] = deque()  # to run: new shards, and failed ones in front
        self.finished: dict[int, ShardResult] = {}  # run, waiting for earlier shards
        self.line_errors: dict[int, list[tuple[int, bytes]]] = {}  # the driver's, by shard
        self.calls: dict[Any, tuple[Engine, Shard]] = {}  # shard calls running
        self.pool = EnginePool(ray, dp, opts, self.per_engine)
        self.next_shard = self.next_write = 0
        self.exhausted = False

    def run(self) -> JobSummary:
        start = time.monotonic()
        opts = self.opts
        check_input(opts.input, opts.output)
        self.answers = Answers(opts.output)
        if self.answers.done_ids or self.answers.lines:
            logger.info(
                "resuming: %d requests and %d error records already written",
                len(self.answers.done_ids),
                len(self.answers.lines),
            )
        record_input(opts.input, opts.output)
        self.out = Appender(opts.output, opts.sync_every_s)
        self.errs = Appender(errors_path(opts.output), opts.sync_every_s)
        self.bar, _ = progress_bar(opts)
        lines = read_lines(opts.input)
        try:
            self.pool.start()
            start = time.monotonic()  # as the single engine's: from a loaded model on
            with Signals() as sig:
                while not sig.abandon:
                    if not sig.stop:
                        self._read(lines)
                    self._write_finished()
                    if not sig.stop:
                        self._dispatch()
                    done = self.exhausted and self.next_write == self.next_shard
                    if done or (sig.stop and not self.calls):
                        break
                    if not self.calls and not self.pool.starting():
                        if self.queue:
                            raise DataParallelError(
                                "every engine died and none may be restarted "
                                f"({self.pool.max_restarts} restarts allowed)"
                            )
                        continue
                    self._collect()
                self.summary.interrupted = not (
                    self.exhausted and self.next_write == self.next_shard
                )
        except DataParallelError:
            self._write_finished()  # what finished in order before the failure
            raise
        finally:
            lines.close()
            if self.bar is not None:
                self.bar.close()
            self.pool.close()
            try:
                self.out.close()
            finally:
                self.errs.close()
        self.summary.wall_s = time.monotonic() - start
        return self.summary

    def _read(self, lines) -> None:
        """Cut shards from the input until `window` shards are unwritten or it ends."""
        answers, size = self.answers, self.dp.shard_size
        while not self.exhausted and self.next_shard - self.next_write < self.window:
            shard, errors = Shard(self.next_shard, []), []
            while len(shard.items) + len(errors) < size:
                nxt = next(lines, None)
                if nxt is None:
                    self.exhausted = True
                    break
                line, raw = nxt
                item, error, cid = answers.read(line, raw)
                verdict = answers.earlier(line, item, cid)
                if verdict is not None:
                    self.summary.skipped += verdict == "done"
                    self.summary.failed_earlier += verdict == "failed"
                    if self.bar is not None:
                        self.bar.update(1)
                elif item is None:
                    errors.append((line, error_record(line, error)))
                else:
                    shard.items.append(item)
            if not shard.items and not errors:
                return
            self.line_errors[shard.index] = errors
            self.next_shard += 1
            if shard.items:
                self.queue.append(shard)
            else:
                self.finished[shard.index] = ShardResult(shard.index)

    def _write_finished(self) -> None:
        """Append every finished shard that has no unfinished shard before it."""
        while self.next_write in self.finished:
            result = self.finished.pop(self.next_write)
            errors = sorted(self.line_errors.pop(self.next_write) + result.errors)
            self.out.write([line for _, line in result.outputs])
            self.errs.write([line for _, line in errors])
            s = self.summary
            s.succeeded += len(result.outputs)
            s.failed += len(errors)
            s.prompt_tokens += result.prompt_tokens
            s.completion_tokens += result.completion_tokens
            if self.bar is not None:
                self.bar.update(len(result.outputs) + len(errors))
            self.next_write += 1
        self.out.tick()
        self.errs.tick()

    def _dispatch(self) -> None:
        """Hand queued shards to the live engines with room, the least busy first."""
        while self.queue:
            engine = self.pool.with_room()
            if engine is None:
                return
            shard = self.queue.popleft()
            self.calls[engine.handle.run_shard.remote(shard)] = (engine, shard)
            engine.in_flight += 1

    def _collect(self) -> None:
        """Wait up to 0.5 s for a shard call to end or an engine to start; handle it."""
        starting = self.pool.starting()
        ready, _ = self.ray.wait([*self.calls, *starting], num_returns=1, timeout=0.5)
        for ref in ready:
            if ref not in self.calls:
                self.pool.on_ready(ref)
                continue
            engine, shard = self.calls.pop(ref)
            engine.in_flight -= 1
            try:
                self.finished[shard.index] = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:  # died, or its engine raised
                self.pool.died(engine, e)  # a worker whose engine raised is broken
                self._retry(shard, e)
        self.pool.check_starts()

    def _retry(self, shard: Shard, error: Exception) -> None:
        shard.attempts += 1
        if shard.attempts >= self.dp.max_shard_attempts:
            first, last = shard.items[0].line, shard.items[-1].line
            raise DataParallelError(
                f"input lines {first}-{last} failed {shard.attempts} times; the last "
                f"error: {first_line(error)}"
            )
        self.queue.appendleft(shard)
