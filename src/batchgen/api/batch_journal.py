"""The job's files: resume scans that repair a torn output, the append-only writer
that syncs at least every few seconds, the line reader that never holds more than one
line of the input, and two small sidecars beside OUTPUT: which input the journal
answers (OUTPUT.input.json) and which lines were in flight when a run stopped on an
error no request could be blamed for (OUTPUT.suspects.json)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 32 << 20


def errors_path(output: Path) -> Path:
    """OUTPUT's sibling errors file: out.jsonl -> out.errors.jsonl."""
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(stem + ".errors.jsonl")


class OutputLocked(Exception):
    """Another process holds the output's lock: it is running a job on the same output."""


class OutputLock:
    """An exclusive, non-blocking flock on OUTPUT.lock, held from acquire() to release()
    by one job at a time, so two runs never append the same results to one output. The
    kernel drops the lock when its holder dies, so a killed job leaves no stale lock. The
    file itself stays (removing it would let a later run lock a fresh file while an
    earlier one still holds the old); it holds the holder's pid, for the error."""

    def __init__(self, output: Path) -> None:
        self.output = output
        real = output.resolve()  # one lock whatever path (relative, via a link) names it
        self.path = real.with_name(real.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise OutputLocked at once (OSError if it cannot be created)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 32).decode("ascii", "replace").strip()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            by = f" (process {holder})" if holder.isdigit() else ""
            raise OutputLocked(
                f"another batchgen run is writing to {self.output}{by}: it holds "
                f"{self.path}. Wait for it to end (or stop it), then rerun this command"
            ) from None
        self.fd = fd
        try:  # the holder's pid, for the message above; the lock works without it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def scan_answered(path: Path, key: str) -> set:
    """Values of `key` (custom_id or line) in a JSONL file written by an earlier run.

    Lines that are not whole JSON objects (a torn last line after a crash) are cut: the
    file is truncated after its last good line, or rewritten without bad lines if any sit
    in the middle.
    """
    found: set = set()

    def take(record: dict) -> None:
        value = (record.get("error") or {}).get("line") if key == "line" else record.get(key)
        if value is not None:
            found.add(value)

    _scan(path, take)
    return found


def scan_errors(path: Path) -> dict[int, str | None]:
    """Input line -> the `line_digest` of its latest error record (None for a record
    written without one), repairing the file as scan_answered does."""
    found: dict[int, str | None] = {}

    def take(record: dict) -> None:
        error = record.get("error") or {}
        if isinstance(error.get("line"), int):
            found[error["line"]] = error.get("line_digest")

    _scan(path, take)
    return found


def _scan(path: Path, take) -> None:
    """Call take(record) for each whole record of `path`; cut or drop the others."""
    if not path.exists():
        return
    good_end, bad_inside, bad_seen, size = 0, False, False, path.stat().st_size
    with open(path, "rb") as f:
        while raw := f.readline():
            record = _record(raw)
            if record is None:
                bad_seen = True
                continue
            bad_inside, good_end = bad_inside or bad_seen, f.tell()
            take(record)
    if bad_inside:
        logger.warning("%s: dropping lines that are not whole JSON records", path)
        tmp = path.with_name(path.name + ".repair")
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            for raw in src:
                if _record(raw) is not None:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    elif good_end < size:
        logger.warning("%s: cutting a torn last line (%d bytes)", path, size - good_end)
        os.truncate(path, good_end)


def count_records(path: Path) -> int:
    """Whole JSON lines in a file (a torn last line is not counted); nothing is repaired."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(_record(raw) is not None for raw in f)


def _record(raw: bytes) -> dict | None:
    """The JSON object of one whole line, or None for a torn or garbled one."""
    if not raw.endswith(b"\n"):
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class Appender:
    """Append-only JSONL writer: whole lines per write(). A timer thread fsyncs written
    lines once `sync_every_s` has passed since they were written, however long the
    caller's engine step takes (tick() does the same from the caller's thread); close()
    syncs what is left. A sync the timer could not make raises from the next write(),
    tick() or close()."""

    def __init__(self, path: Path, sync_every_s: float) -> None:
        self.path, self.sync_every_s = path, sync_every_s
        self.fd: int | None = None
        self.dirty = False
        self.last_sync = time.monotonic()
        self._lock = threading.Lock()  # the descriptor and `dirty`, between the threads
        self._closed = threading.Event()
        self._timer: threading.Thread | None = None
        self._timer_error: OSError | None = None

    def write(self, lines: list[bytes]) -> None:
        """Append whole lines; an OSError (a full disk: ENOSPC) names this file."""
        self._raise_timer_error()
        if lines:
            with self._lock:
                try:
                    if self.fd is None:
                        created = not self.path.exists()
                        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                        if created:
                            _fsync_dir(self.path.parent)
                    if not self.dirty:
                        self.dirty, self.last_sync = True, time.monotonic()
                    self._write(b"".join(lines))
                except OSError as e:
                    self._name(e)
                    raise
            self._start_timer()
        self.tick()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def tick(self) -> None:
        self._raise_timer_error()
        if self.dirty and time.monotonic() - self.last_sync >= self.sync_every_s:
            self.sync()

    def sync(self) -> None:
        with self._lock:
            if self.fd is not None and self.dirty:
                try:
                    os.fsync(self.fd)
                except OSError as e:
                    self._name(e)
                    raise
            self.dirty, self.last_sync = False, time.monotonic()

    def close(self) -> None:
        """Sync and close; the descriptor is closed even when the sync fails."""
        self._closed.set()
        if self._timer is not None:
            self._timer.join()
        if self.fd is not None:
            try:
                self.sync()
            finally:
                with self._lock:
                    os.close(self.fd)
                    self.fd = None
        self._raise_timer_error()

    def _start_timer(self) -> None:
        if self._timer is None and self.sync_every_s > 0:
            self._timer = threading.Thread(
                target=self._sync_on_time, name=f"sync {self.path.name}", daemon=True
            )
            self._timer.start()

    def _sync_on_time(self) -> None:
        while not self._closed.wait(self.sync_every_s / 4):
            if self.dirty and time.monotonic() - self.last_sync >= self.sync_every_s:
                try:
                    self.sync()
                except OSError as e:
                    self._timer_error = e
                    return

    def _raise_timer_error(self) -> None:
        if self._timer_error is not None:
            error, self._timer_error = self._timer_error, None
            raise error

    def _name(self, error: OSError) -> None:
        if error.filename is None:  # os.write/os.fsync errors name no file
            error.filename = str(self.path)


def _fsync_dir(path: Path) -> None:
    """Make a new file's directory entry durable (POSIX; a no-op where dirs can't open)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def count_lines(path: Path) -> int:
    """How many lines read_lines yields for `path` (a last line without a newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            n, last = n + chunk.count(b"\n"), chunk[-1:]
    return n + (last != b"\n")


def read_lines(path: Path):
    """Yield (line number, bytes) one line at a time; a line over MAX_LINE_BYTES yields
    None in place of its bytes (its rest is read past, never held)."""
    with open(path, "rb", buffering=1 << 20) as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                yield number, None
            else:
                yield number, raw.rstrip(b"\r\n")


class InputMismatch(Exception):
    """OUTPUT's journal answers another input file: resuming it with this input would
    skip lines that never ran. The message says what to do (a usage error, exit 2)."""


HEAD_LINES = 8  # input lines whose digests identify the input a journal answers


def input_record_path(output: Path) -> Path:
    return output.with_name(output.name + ".input.json")


def input_head(path: Path) -> list[str]:
    """Digests of the input's first HEAD_LINES lines (as read_lines yields them)."""
    head = []
    for _, raw in read_lines(path):
        head.append(hashlib.blake2b(raw or b"", digest_size=12).hexdigest())
        if len(head) == HEAD_LINES:
            break
    return head


def check_input(input_path: Path, output: Path) -> None:
    """Raise InputMismatch when OUTPUT's journal was written for another input: none of
    the first HEAD_LINES lines recorded for it is the same line of `input_path`. Lines
    fixed in place keep the others matching; a journal with no record passes."""
    if not (output.exists() or errors_path(output).exists()):
        return  # nothing answered: a record left beside no journal binds nothing
    record = _read_json(input_record_path(output))
    if not isinstance(record, dict) or not isinstance(record.get("head"), list):
        return
    recorded, head = record["head"], input_head(input_path)
    if not recorded or not head:
        return
    if any(a == b for a, b in zip(recorded, head)):
        return
    raise InputMismatch(
        f"{output} holds the answers to another input ({record.get('input')}): none of "
        f"the first {min(len(recorded), len(head))} lines of {input_path} is a line it "
        f"answered. Write this input's answers to another output file; if this really is "
        f"the same input with its first lines edited, delete {input_record_path(output)}"
    )


def record_input(input_path: Path, output: Path) -> None:
    """Note which input OUTPUT's journal answers (check_input reads it on a rerun)."""
    record = {"input": str(input_path.resolve()), "head": input_head(input_path)}
    _write_json(input_record_path(output), record)


def suspects_path(output: Path) -> Path:
    return output.with_name(output.name + ".suspects.json")


def read_suspects(output: Path) -> dict[int, str | None]:
    """Input line -> its digest, for the lines in flight when a run stopped on an
    error that named no request; {} when there are none."""
    record = _read_json(suspects_path(output))
    if not isinstance(record, dict) or not isinstance(record.get("lines"), dict):
        return {}
    return {int(k): v for k, v in record["lines"].items() if str(k).isdigit()}


def write_suspects(output: Path, lines: dict[int, str | None], error: str) -> None:
    _write_json(suspects_path(output), {"error": error, "lines": lines})


def clear_suspects(output: Path) -> None:
    try:
        os.unlink(suspects_path(output))
    except FileNotFoundError:
        pass


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj) -> None:
    """Write a small JSON file whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
