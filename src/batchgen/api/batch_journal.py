"""The job's files: resume scans that repair a torn output, the append-only writer
that syncs at least every few seconds, and the line reader that never holds more than
one line of the input."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
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
    if not path.exists():
        return found
    good_end, bad_inside, bad_seen, size = 0, False, False, path.stat().st_size
    with open(path, "rb") as f:
        while raw := f.readline():
            record = _record(raw)
            if record is None:
                bad_seen = True
                continue
            bad_inside, good_end = bad_inside or bad_seen, f.tell()
            value = (record.get("error") or {}).get("line") if key == "line" else record.get(key)
            if value is not None:
                found.add(value)
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
    return found


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
    """Append-only JSONL writer: whole lines per write(); tick() fsyncs written lines once
    `sync_every_s` has passed since the last sync; close() syncs what is left."""

    def __init__(self, path: Path, sync_every_s: float) -> None:
        self.path, self.sync_every_s = path, sync_every_s
        self.fd: int | None = None
        self.dirty = False
        self.last_sync = time.monotonic()

    def write(self, lines: list[bytes]) -> None:
        """Append whole lines; an OSError (a full disk: ENOSPC) names this file."""
        if lines:
            try:
                if self.fd is None:
                    created = not self.path.exists()
                    self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    if created:
                        _fsync_dir(self.path.parent)
                self.dirty = True
                self._write(b"".join(lines))
            except OSError as e:
                self._name(e)
                raise
        self.tick()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def tick(self) -> None:
        if self.dirty and time.monotonic() - self.last_sync >= self.sync_every_s:
            self.sync()

    def sync(self) -> None:
        if self.fd is not None and self.dirty:
            try:
                os.fsync(self.fd)
            except OSError as e:
                self._name(e)
                raise
        self.dirty, self.last_sync = False, time.monotonic()

    def close(self) -> None:
        """Sync and close; the descriptor is closed even when the sync fails."""
        if self.fd is not None:
            try:
                self.sync()
            finally:
                os.close(self.fd)
                self.fd = None

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
