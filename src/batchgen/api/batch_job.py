"""A resumable batch job: input JSONL -> engine -> append-only output JSONL.

    input ──read one line at a time──> parse/validate ──> engine (at most max_in_flight)
      │                                     │ bad line              │ finished requests
      │                                     v                       v
      └── lines already answered ──>  OUTPUT.errors.jsonl        OUTPUT (append-only)
          are skipped

Invariants:
- Every output line is written whole with one write() on an O_APPEND descriptor right
  after its request finishes, and both files are fsync'ed at least every `sync_every_s`.
- A rerun scans OUTPUT (custom_ids done) and the errors file (line numbers answered),
  cuts a torn last line, and skips those input lines: each custom_id is written once.
- Memory holds the custom_ids seen with their first line (for duplicate detection), the
  answered line numbers and at most max_in_flight requests, never the input's contents.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.api import batch_file as bf
from batchgen.api.batch_journal import (
    MAX_LINE_BYTES,
    Appender,
    count_lines,
    errors_path,
    read_lines,
    scan_answered,
)
from batchgen.engine.memory import fewer_full_collections

logger = logging.getLogger(__name__)


@dataclass
class JobOptions:
    input: Path
    output: Path
    model_name: str
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword defaults
    seed: int | None = None  # base of the per-request seed of requests without one
    max_in_flight: int = 64
    progress: bool = True
    sync_every_s: float = 2.0


@dataclass
class JobSummary:
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0  # answered by an earlier run (success)
    failed_earlier: int = 0  # answered by an earlier run (error record)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    # the engine's preemptions over the job: swapped (host tier) or recomputed, and the
    # prompt tokens the host tier served; empty when nothing was preempted or loaded
    kv: dict[str, int] = field(default_factory=dict)

    def describe(self, errors_path: Path) -> str:
        rate = self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0
        failed = f"{self.failed} failed"
        if self.failed_earlier:
            failed += f" (+{self.failed_earlier} in earlier runs)"
        text = (
            f"{self.succeeded} succeeded, {failed}, {self.skipped} skipped as already done;"
            f" tokens in {self.prompt_tokens}, out {self.completion_tokens};"
            f" {self.wall_s:.1f} s, {rate:.1f} output tok/s"
        )
        if self.kv:
            text += (
                f"; KV: {self.kv['preemptions']} preemptions ({self.kv['swaps_out']} swapped "
                f"to host, {self.kv['recomputes']} recomputed), "
                f"{self.kv['host_prefix_hit_tokens']} prompt tokens loaded from host"
            )
        if self.failed or self.failed_earlier:
            text += f"; error records in {errors_path}"
        return text


class _LineCounter(threading.Thread):
    """Counts the input's lines in the background, for the progress bar's total."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.total = path, None

    def run(self) -> None:
        self.total = count_lines(self.path)


class Signals:
    """First SIGINT/SIGTERM: stop admitting, finish what is in flight. Second: stop now."""

    def __init__(self) -> None:
        self.stop = self.abandon = False
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
        self.stop = True
        logger.warning(
            "%s: no new requests; finishing those in flight (send it again to stop "
            "now; a rerun resumes either way)",
            signal.Signals(signum).name,
        )

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Answers:
    """What earlier runs answered (custom_ids in OUTPUT, line numbers in the errors file,
    after the resume scan's repair) and the custom_ids read so far with their first line;
    decides, line by line, which input lines an earlier run already answered."""

    def __init__(self, output: Path) -> None:
        self.done_ids: set[str] = scan_answered(output, "custom_id")
        self.lines: set[int] = scan_answered(errors_path(output), "line")
        self.seen: dict[str, int] = {}  # custom_id -> the first line that has it

    def read(self, line: int, raw: bytes | None):
        """(item, error, custom_id) of one input line; a repeated custom_id is an error."""
        item, error = None, None
        try:
            if raw is None:
                raise bf.LineError(f"the line is longer than {MAX_LINE_BYTES} bytes")
            item = bf.parse_line(raw, line)
        except bf.LineError as e:
            error = e
        cid = item.custom_id if item is not None else error.custom_id
        if cid is not None:
            if cid in self.seen:
                item, error = None, bf.duplicate_error(cid, self.seen[cid])
            else:
                self.seen[cid] = line
        return item, error, cid

    def earlier(self, line: int, item, cid: str | None) -> str | None:
        """How an earlier run answered this line: "failed", "done", or None (not yet)."""
        if line in self.lines:
            return "failed"
        if item is not None and cid in self.done_ids:
            self.done_ids.discard(cid)
            return "done"
        return None


def answered_earlier(opts: JobOptions) -> JobSummary | None:
    """Without a model: the summary of a job whose every input line earlier runs
    answered (nothing is left to run), or None when some line is still to run."""
    start = time.monotonic()
    answers = Answers(opts.output)
    if count_lines(opts.input) > len(answers.done_ids) + len(answers.lines):
        return None  # each answer covers one line at most: some line is unanswered
    summary = JobSummary()
    for line, raw in read_lines(opts.input):
        item, _, cid = answers.read(line, raw)
        verdict = answers.earlier(line, item, cid)
        if verdict is None:
            return None
        summary.skipped += verdict == "done"
        summary.failed_earlier += verdict == "failed"
    summary.wall_s = time.monotonic() - start
    return summary


def run_batch_job(llm, opts: JobOptions) -> JobSummary:
    """Run every unanswered line of opts.input through llm; see the module docstring."""
    start = time.monotonic()
    summary = JobSummary()
    err_path = errors_path(opts.output)
    answers = Answers(opts.output)
    if answers.done_ids or answers.lines:
        logger.info(
            "resuming: %d requests and %d error records already written",
            len(answers.done_ids),
            len(answers.lines),
        )
    out, errs = Appender(opts.output, opts.sync_every_s), Appender(err_path, opts.sync_every_s)
    pending: dict[str, bf.Pending] = {}
    engine = llm.engine
    kv_before = _kv_counters(engine)
    bar, counter = progress_bar(opts)

    def fail(line: int, cid: str | None, error: Exception) -> None:
        summary.failed += 1
        message = str(error) or type(error).__name__
        duplicate_of = getattr(error, "duplicate_of", None)
        errs.write([bf.dumps(bf.error_line(line, cid, message, duplicate_of))])
        if bar is not None:
            bar.update(1)

    def admit(line: int, raw: bytes | None) -> None:
        item, error, cid = answers.read(line, raw)
        verdict = answers.earlier(line, item, cid)
        if verdict is not None:
            summary.skipped += verdict == "done"
            summary.failed_earlier += verdict == "failed"
            if bar is not None:
                bar.update(1)
            return
        if item is None:
            return fail(line, cid, error)
        try:
            ids, params = prepare_request(llm, item, opts)
            engine.add_request(str(line), ids, params, validated=True)  # prepare_request ran it
        except Exception as e:  # a bad line must never stop the job
            return fail(line, cid, e)
        pending[str(line)] = bf.Pending(line, cid, item.url, params.logprobs)

    lines = read_lines(opts.input)
    exhausted = False
    try:
        with Signals() as sig, fewer_full_collections():
            while not sig.abandon:
                while not (sig.stop or exhausted) and len(pending) < opts.max_in_flight:
                    nxt = next(lines, None)
                    exhausted = nxt is None
                    if nxt is not None:
                        admit(*nxt)
                if not engine.has_unfinished:
                    if exhausted or sig.stop:
                        break
                    continue
                finished = engine.step()
                errs.tick()
                out.write(
                    [_finish(pending.pop(r.request_id), r, opts, llm, summary) for r in finished]
                )
                if bar is not None:
                    bar.update(len(finished))
                    if bar.total is None and counter.total is not None:
                        bar.total = counter.total
                    elapsed = time.monotonic() - start
                    bar.set_postfix_str(
                        f"{summary.completion_tokens / elapsed:.0f} out tok/s", refresh=False
                    )
            summary.interrupted = sig.stop and not (exhausted and not pending)
    finally:
        lines.close()
        if bar is not None:
            bar.close()
        try:  # both files are synced and closed, even when one fails (a full disk)
            out.close()
        finally:
            errs.close()
    summary.wall_s = time.monotonic() - start
    kv = {k: v - kv_before[k] for k, v in _kv_counters(engine).items()}
    summary.kv = kv if any(kv.values()) else {}
    return summary


def _kv_counters(engine) -> dict[str, int]:
    """Preemptions, how they were resolved, and host-tier prefix hits, so far."""
    m = engine.metrics()
    keys = ("preemptions", "swaps_out", "recomputes", "host_prefix_hit_tokens")
    return {k: int(m.get(k, 0)) for k in keys}


def prepare_request(llm, item: bf.BatchItem, opts: JobOptions):
    """(prompt token ids, SamplingParams) of one item, checked by the engine; raises on
    a line the engine refuses (the caller writes its error record)."""
    defaults = opts.defaults
    if opts.seed is not None:  # a seed from the custom_id: reruns sample the same tokens
        digest = hashlib.blake2b(f"{opts.seed}:{item.custom_id}".encode(), digest_size=8)
        defaults = {**defaults, "seed": int.from_bytes(digest.digest(), "little") >> 1}
    params = bf.sampling_params(item.body, item.url, defaults)
    ids = bf.encode(llm, item)
    llm.engine.validate(ids, params, f"request {item.custom_id!r}")
    return ids, params


def _finish(p: bf.Pending, req, opts: JobOptions, llm, summary: JobSummary) -> bytes:
    summary.succeeded += 1
    summary.prompt_tokens += len(req.prompt_token_ids)
    summary.completion_tokens += len(req.output_token_ids)
    return bf.dumps(bf.output_line(p, req, opts.model_name, llm.tokenizer))


def progress_bar(opts: JobOptions):
    """(tqdm bar, background line counter for its total), or (None, None) off a terminal."""
    if not opts.progress or not sys.stderr.isatty():
        return None, None
    from tqdm.auto import tqdm

    counter = _LineCounter(opts.input)
    counter.start()
    bar = tqdm(total=None, desc="batch", unit="req", dynamic_ncols=True, file=sys.stderr)
    return bar, counter
