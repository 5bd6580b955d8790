"""Resume decisions, line by line: which input lines earlier runs answered (a result
in OUTPUT by custom_id, an error record by line number and the line's digest), which
custom_ids repeat, and, without a model, whether any line is left to run at all."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo
from batchgen.api.batch_journal import (
    MAX_LINE_BYTES,
    Appender,
    check_input,
    errors_path,
    read_lines,
    record_input,
    scan_answered,
    scan_errors,
)
from batchgen.api.batch_summary import JobOptions, JobSummary

logger = logging.getLogger(__name__)

# bad lines answered_earlier holds, at most, to write itself when no line is runnable
MAX_BAD_LINES_HELD = 4096


class Answers:
    """What earlier runs answered (custom_ids in OUTPUT, line numbers in the errors file
    with the digest of the line each record answers, after the resume scan's repair) and
    the custom_ids read so far with their first line; decides, line by line, which
    input lines an earlier run already answered."""

    def __init__(self, output: Path, warn: bool = True) -> None:
        self.done_ids: set[str] = scan_answered(output, "custom_id")
        self.lines: dict[int, str | None] = scan_errors(errors_path(output))
        self.seen: dict[str, int] = {}  # custom_id -> the first line that has it
        self.this_run: set[int] = set()  # lines this run answered before reading them
        self._warned: set[str] = set()
        self._warn = warn

    def read(self, line: int, raw: bytes | None):
        """(item, error, custom_id) of one input line; a repeated custom_id is an error.
        Both item and error carry the line's digest. A body key OpenAI accepts that
        batchgen ignores is logged the first time a line has it."""
        item, error = None, None
        digest = bf.line_digest(raw) if raw is not None else None
        try:
            if raw is None:
                raise bf.LineError(f"the line is longer than {MAX_LINE_BYTES} bytes")
            item = bf.parse_line(raw, line)
        except bf.LineError as e:
            error = e
        cid = item.custom_id if item is not None else error.custom_id
        if cid is not None:
            if cid in self.seen and line not in self.this_run:
                item, error = None, bf.duplicate_error(cid, self.seen[cid])
            else:
                self.seen.setdefault(cid, line)
        if item is not None:
            item.digest = digest
            for key in item.ignored if self._warn else ():
                if key not in self._warned:
                    self._warned.add(key)
                    logger.warning(
                        "body.%s (first on line %d) is ignored: batchgen accepts it as "
                        "OpenAI does but it changes nothing here",
                        key,
                        line,
                    )
        else:
            error.digest = digest
        return item, error, cid

    def earlier(self, line: int, item, cid: str | None) -> str | None:
        """How an earlier run answered this line: "failed", "done", "this run" (the
        run answered it before its turn: a suspect run alone), or None (not yet). An
        error record answers the line only while the line's text is what it answered."""
        if line in self.this_run:
            return "this run"
        if line in self.lines:
            recorded = self.lines[line]
            digest = item.digest if item is not None else None
            if recorded is None or digest is None or recorded == digest:
                return "failed"
        if item is not None and cid in self.done_ids:
            self.done_ids.discard(cid)
            return "done"
        return None

    def answered(self, line: int, item: bf.BatchItem) -> bool:
        """Whether an earlier run answered this line (earlier() without counting it)."""
        recorded = self.lines.get(line, "")
        failed = line in self.lines and recorded in (None, item.digest)
        return failed or item.custom_id in self.done_ids

    def count(self, verdict: str, summary: JobSummary) -> None:
        summary.skipped += verdict == "done"
        summary.failed_earlier += verdict == "failed"


def answered_earlier(opts: JobOptions) -> JobSummary | None:
    """Without a model: the summary of a job with no line left to run, or None when
    some line is still to run. Nothing is left when every line is answered (by earlier
    runs), bad (its error record is written here), or the input is empty; `note` then
    says what was found. Raises batch_journal.InputMismatch when OUTPUT answers another
    input. Reads the input up to its first runnable line."""
    start = time.monotonic()
    check_input(opts.input, opts.output)
    answers = Answers(opts.output, warn=False)  # the job warns, once per key
    summary = JobSummary()
    bad: list[bytes] = []
    total = 0
    for line, raw in read_lines(opts.input):
        total += 1
        item, error, cid = answers.read(line, raw)
        verdict = answers.earlier(line, item, cid)
        if verdict is not None:
            answers.count(verdict, summary)
        elif item is not None or len(bad) == MAX_BAD_LINES_HELD:
            return None  # a line to run (or too many bad ones to hold: the job writes them)
        else:
            bad.append(error_record(line, error))
    err_path = errors_path(opts.output)
    if total == 0:
        summary.note = "the input is empty"
    elif bad:
        errs = Appender(err_path, opts.sync_every_s)
        try:
            errs.write(bad)
        finally:
            errs.close()
        record_input(opts.input, opts.output)
        summary.failed = len(bad)
        earlier = total - len(bad)
        summary.note = (
            f"{total} lines, none runnable: {len(bad)} bad lines (error records in "
            f"{err_path})" + (f", {earlier} answered by earlier runs" if earlier else "")
        )
    summary.wall_s = time.monotonic() - start
    return summary


def error_record(line: int, error: bf.LineError, code: str = "invalid_request") -> bytes:
    """The JSONL error record of an input line, with what the line had as custom_id and
    the line's digest (both carried by `error`)."""
    message = str(error) or type(error).__name__
    duplicate_of = getattr(error, "duplicate_of", None)
    record_id = getattr(error, "record_id", None)
    digest = getattr(error, "digest", None)
    return bo.dumps(bo.error_line(line, record_id, message, duplicate_of, digest, code))
