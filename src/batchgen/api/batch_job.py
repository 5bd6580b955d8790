"""A resumable batch job: input JSONL -> engine -> append-only output JSONL.

    input ──read one line at a time──> parse/validate ──> engine (at most max_in_flight)
      │                                     │ bad line              │ finished requests
      │                                     v                       v
      └── lines already answered ──>  OUTPUT.errors.jsonl        OUTPUT (append-only)
          are skipped                       ^
                                            └── a request a step failed for (poison line)

Invariants:
- Every output line is written whole with one write() on an O_APPEND descriptor right
  after its request finishes, and both files are fsync'ed at least every `sync_every_s`
  (the Appender's timer).
- A rerun scans OUTPUT (custom_ids done) and the errors file (line numbers answered,
  with the digest of the line each record answers), cuts a torn last line, and skips
  those input lines: each custom_id is written once; a line edited since its error
  record runs again.
- Memory holds the custom_ids seen with their first line (for duplicate detection), the
  answered line numbers and at most max_in_flight requests, never the input's contents.
- A step that fails for some requests (engine_core.RequestsFailed) fails their lines
  alone. A step that fails naming no request stops the job after noting the lines in
  flight (OUTPUT.suspects.json); the rerun runs each of them alone first, so the one
  that fails alone gets an error record and the others their answers.
- The first SIGINT/SIGTERM admits nothing more: requests not running yet are dropped at
  once, running ones get grace_s seconds, then are dropped; dropped lines run on the
  rerun. A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo
from batchgen.api.batch_journal import (
    Appender,
    check_input,
    clear_suspects,
    count_lines,
    errors_path,
    read_lines,
    read_suspects,
    record_input,
    write_suspects,
)
from batchgen.api.batch_requests import InFlight, prepare_line
from batchgen.api.batch_resume import Answers, answered_earlier, error_record
from batchgen.api.batch_summary import JobOptions, JobSummary
from batchgen.engine.engine_core import RequestsFailed
from batchgen.engine.memory import fewer_full_collections

# what a job's callers and drivers import from here (the CLI, data_parallel, shard_worker)
__all__ = [
    "Answers",
    "JobOptions",
    "JobSummary",
    "Signals",
    "answered_earlier",
    "error_record",
    "errors_path",
    "progress_bar",
    "run_batch_job",
]

logger = logging.getLogger(__name__)


class _LineCounter(threading.Thread):
    """Counts the input's lines in the background, for the progress bar's total."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.total = path, None

    def run(self) -> None:
        self.total = count_lines(self.path)


class Signals:
    """First SIGINT/SIGTERM: stop admitting (`stop`, at `stopped_at`). Second: stop now
    (`abandon`)."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.stop = self.abandon = False
        self.stopped_at = 0.0
        self.grace_s = grace_s
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.stop:
            self.abandon = True
            return
        self.stop, self.stopped_at = True, time.monotonic()
        running = (
            "finishing those in flight"
            if self.grace_s is None
            else f"those running get {self.grace_s:g} s to finish, the rest run on the rerun"
        )
        logger.warning(
            "%s: no new requests; %s (send it again to stop now; a rerun resumes either way)",
            signal.Signals(signum).name,
            running,
        )

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run_batch_job(llm, opts: JobOptions) -> JobSummary:
    """Run every unanswered line of opts.input through llm; see the module docstring.
    Raises batch_journal.InputMismatch when OUTPUT answers another input."""
    check_input(opts.input, opts.output)
    return _Job(llm, opts).run()


class _Job:
    def __init__(self, llm, opts: JobOptions) -> None:
        self.llm, self.opts, self.engine = llm, opts, llm.engine
        self.summary = JobSummary()
        self.answers = Answers(opts.output)
        self.flight = InFlight(self.engine)
        self.failed_alone = False  # a suspect failed alone in this process
        self.dropped = 0  # lines taken out unfinished after a signal

    def run(self) -> JobSummary:
        opts, answers = self.opts, self.answers
        start = time.monotonic()
        if answers.done_ids or answers.lines:
            logger.info(
                "resuming: %d requests and %d error records already written",
                len(answers.done_ids),
                len(answers.lines),
            )
        record_input(opts.input, opts.output)
        self.out = Appender(opts.output, opts.sync_every_s)
        self.errs = Appender(errors_path(opts.output), opts.sync_every_s)
        kv_before = _kv_counters(self.engine)
        self.bar, self.counter = progress_bar(opts)
        self.start = start
        lines = read_lines(opts.input)
        try:
            with Signals(opts.grace_s) as sig, fewer_full_collections():
                self._run_suspects(sig)
                exhausted = self._main_loop(sig, lines)
            s = self.summary
            s.interrupted = sig.stop and not (
                exhausted and not len(self.flight) and not self.dropped
            )
        finally:
            lines.close()
            if self.bar is not None:
                self.bar.close()
            try:  # both files are synced and closed, even when one fails (a full disk)
                self.out.close()
            finally:
                self.errs.close()
        self.summary.wall_s = time.monotonic() - start
        kv = {k: v - kv_before[k] for k, v in _kv_counters(self.engine).items()}
        self.summary.kv = kv if any(kv.values()) else {}
        return self.summary

    def _main_loop(self, sig: Signals, lines) -> bool:
        """Admit, step and write until the input is done or a signal stops the job;
        returns whether the input was read to its end."""
        flight, exhausted, stopping = self.flight, False, False
        while not sig.abandon:
            if sig.stop:
                if not stopping:
                    stopping = True
                    self._drop(flight.not_started(), "not started")
                if time.monotonic() - sig.stopped_at >= self.opts.grace_s and len(flight):
                    self._drop(flight.lines(), "still running after the grace period")
                if not len(flight):
                    break
            while not (sig.stop or exhausted) and len(flight) < self.opts.max_in_flight:
                nxt = next(lines, None)
                exhausted = nxt is None
                if nxt is not None:
                    self._admit(*nxt)
            if not self.engine.has_unfinished:
                if exhausted or sig.stop:
                    break
                continue
            self._step()
        return exhausted

    def _drop(self, pending: list[bo.Pending], why: str) -> None:
        for p in pending:
            self.flight.drop(p)
        self.dropped += len(pending)
        if pending:
            logger.info("%d lines %s: dropped, they run on the rerun", len(pending), why)

    def _step(self) -> None:
        """One engine step: write the lines it finished, and fail the lines it failed for."""
        try:
            finished = self.engine.step()
        except RequestsFailed as e:
            for rid, error in e.errors.items():
                pending = self.flight.pending_of(rid)
                if pending is not None:
                    self.flight.drop(pending)
                    self._fail_pending(pending, f"the request failed inside the engine: {error}")
            return
        except Exception as e:  # names no request: note the lines in flight, stop
            self._note_suspects(e)
            raise
        records = []
        for req in finished:
            pending = self.flight.finished(req)
            if pending is not None:
                records.append(self._finish(pending))
        self.errs.tick()
        self.out.write(records)
        self._progress(len(records))

    def _note_suspects(self, error: Exception) -> None:
        suspects = {p.line: p.digest for p in self.flight.lines()}
        if suspects:
            write_suspects(self.opts.output, suspects, f"{type(error).__name__}: {error}")
            logger.error(
                "an engine step failed naming no request; the %d lines in flight are noted "
                "in %s: the rerun runs each of them alone first",
                len(suspects),
                self.opts.output.name + ".suspects.json",
            )

    def _run_suspects(self, sig: Signals) -> None:
        """Run each line an earlier run noted as in flight when a step failed naming no
        request, alone: a line that fails alone gets an error record (the first in this
        process; a second failure stops the job and leaves the rest noted)."""
        left = read_suspects(self.opts.output)
        if not left:
            return
        logger.warning(
            "%d lines were in flight when an earlier run stopped on an engine error that "
            "named no request: running each of them alone first",
            len(left),
        )
        for line, raw in read_lines(self.opts.input):
            if sig.stop or not left:
                break
            if line not in left:
                continue
            del left[line]
            try:
                item = bf.parse_line(raw, line) if raw is not None else None
            except bf.LineError:
                item = None  # its turn in the main pass writes its record
            if item is None:
                continue
            item.digest = bf.line_digest(raw)
            if self.answers.answered(line, item):
                continue  # its turn in the main pass counts it
            try:
                self._run_alone(item)
            except Exception:
                left[line] = item.digest
                write_suspects(self.opts.output, left, "stopped while running them alone")
                raise
            self.answers.this_run.add(line)
        self.out.sync()
        self.errs.sync()
        if left and sig.stop:
            write_suspects(self.opts.output, left, "interrupted while running them alone")
        else:
            clear_suspects(self.opts.output)

    def _run_alone(self, item: bf.BatchItem) -> None:
        if not self._add(item):
            return
        pending = self.flight.lines()[0]
        try:
            while len(self.flight):
                self._step_alone()
        except RequestsFailed as e:
            self.flight.drop(pending)
            self._fail_pending(pending, f"the request failed inside the engine: {e}")
        except Exception as e:
            if self.failed_alone:
                raise  # the engine may be what is broken: a fresh process decides
            self.failed_alone = True
            self.flight.drop(pending)
            self._fail_pending(
                pending,
                "the request failed inside the engine when run alone (it was in flight "
                f"when an earlier run stopped on an error): {type(e).__name__}: {e}",
            )

    def _step_alone(self) -> None:
        finished = self.engine.step()  # RequestsFailed too is this line's failure here
        records = [r for r in map(self.flight.finished, finished) if r is not None]
        self.out.write([self._finish(p) for p in records])
        self._progress(len(records))

    def _admit(self, line: int, raw: bytes | None) -> None:
        item, error, cid = self.answers.read(line, raw)
        verdict = self.answers.earlier(line, item, cid)
        if verdict is not None:
            self.answers.count(verdict, self.summary)
            if verdict != "this run":
                self._progress(1)
            return
        if item is None:
            return self._fail(line, error)
        self._add(item)

    def _add(self, item: bf.BatchItem) -> bool:
        """Put a line's requests in the engine; a line it refuses gets its record."""
        try:
            ids, params, children = prepare_line(self.llm, item, self.opts.defaults, self.opts.seed)
            self.flight.add(item, ids, params, children)
        except Exception as e:  # a bad line must never stop the job
            error = e if isinstance(e, bf.LineError) else bf.LineError(str(e), item.custom_id)
            error.digest = item.digest
            self._fail(item.line, error)
            return False
        return True

    def _fail(self, line: int, error: bf.LineError, code: str = "invalid_request") -> None:
        self.summary.failed += 1
        self.errs.write([error_record(line, error, code)])
        self._progress(1)

    def _fail_pending(self, p: bo.Pending, message: str) -> None:
        error = bf.LineError(message, p.custom_id)
        error.digest = p.digest
        self._fail(p.line, error, "engine_error")

    def _finish(self, p: bo.Pending) -> bytes:
        s = self.summary
        n_in, n_out = p.usage
        s.succeeded += 1
        s.prompt_tokens += n_in
        s.completion_tokens += n_out
        return bo.dumps(bo.output_line(p, self.opts.model_name, self.llm.tokenizer))

    def _progress(self, done: int) -> None:
        bar = self.bar
        if bar is None or not done:
            return
        bar.update(done)
        if bar.total is None and self.counter.total is not None:
            bar.total = self.counter.total
        elapsed = time.monotonic() - self.start
        bar.set_postfix_str(
            f"{self.summary.completion_tokens / elapsed:.0f} out tok/s", refresh=False
        )


def _kv_counters(engine) -> dict[str, int]:
    """Preemptions, how they were resolved, and host-tier prefix hits, so far."""
    m = engine.metrics()
    keys = ("preemptions", "swaps_out", "recomputes", "host_prefix_hit_tokens")
    return {k: int(m.get(k, 0)) for k in keys}


def progress_bar(opts: JobOptions):
    """(tqdm bar, background line counter for its total), or (None, None) off a terminal."""
    if not opts.progress or not sys.stderr.isatty():
        return None, None
    from tqdm.auto import tqdm

    counter = _LineCounter(opts.input)
    counter.start()
    bar = tqdm(total=None, desc="batch", unit="req", dynamic_ncols=True, file=sys.stderr)
    return bar, counter
