"""batch_journal: the output lock, the writer on a full disk, counting whole records."""

from __future__ import annotations

import errno
import os
import time

import pytest

from batchgen.api import batch_journal as bj


def test_output_lock_admits_one_holder_at_a_time(tmp_path):
    out = tmp_path / "out.jsonl"
    first, second = bj.OutputLock(out), bj.OutputLock(tmp_path / "." / "out.jsonl")
    with first:
        assert first.path == tmp_path / "out.jsonl.lock"
        with pytest.raises(
            bj.OutputLocked, match=rf"writing to .*out\.jsonl \(process {os.getpid()}\)"
        ):
            second.acquire()
        assert second.fd is None
    with second:  # released: the next run gets it
        pass
    assert not out.exists()


def test_appender_on_a_full_disk_names_its_file_and_still_closes(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    app = bj.Appender(path, sync_every_s=3600)
    app.write([b'{"a": 1}\n'])
    fd = app.fd

    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(app, "_write", no_space)
    with pytest.raises(OSError) as info:
        app.write([b'{"a": 2}\n'])
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)

    monkeypatch.setattr(bj.os, "fsync", no_space)
    with pytest.raises(OSError) as info:
        app.close()
    assert info.value.filename == str(path)
    assert app.fd is None
    with pytest.raises(OSError):
        os.fstat(fd)  # closed despite the failed sync


def test_count_records_skips_a_torn_line_and_repairs_nothing(tmp_path):
    path = tmp_path / "out.jsonl"
    data = b'{"a": 1}\n{"a": 2}\n{"a": '
    path.write_bytes(data)
    assert bj.count_records(path) == 2
    assert path.read_bytes() == data
    assert bj.count_records(tmp_path / "missing.jsonl") == 0


def test_appender_syncs_on_time_while_its_caller_is_busy(tmp_path, monkeypatch):
    """Written lines are synced within about sync_every_s although the caller never
    calls write() or tick() again (a long engine step). The bound allows a busy machine
    a second of scheduling delay; a sync that waited for the caller never comes."""
    synced: list[float] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(time.monotonic())
        real_fsync(fd)

    monkeypatch.setattr(bj.os, "fsync", fsync)
    app = bj.Appender(tmp_path / "out.jsonl", sync_every_s=0.2)
    app.write([b'{"a": 1}\n'])
    written = time.monotonic()
    synced.clear()  # the directory's sync at creation
    deadline = written + 10
    while not synced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert synced and synced[0] - written < 0.2 + 1.0, synced
    count = len(synced)
    time.sleep(0.4)
    assert len(synced) == count  # nothing new written: nothing to sync
    app.close()


def test_input_check_refuses_another_input_and_accepts_edited_lines(tmp_path):
    first, other, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    first.write_bytes(b"".join(b'{"id": "%d", "prompt": "w5"}\n' % i for i in range(12)))
    other.write_bytes(b"".join(b'{"id": "x%d", "prompt": "w6"}\n' % i for i in range(12)))
    bj.check_input(other, out)  # nothing answered yet
    out.write_bytes(b"")
    bj.record_input(first, out)
    bj.check_input(first, out)
    with pytest.raises(bj.InputMismatch, match=r"holds the answers to another input"):
        bj.check_input(other, out)
    lines = first.read_bytes().splitlines(keepends=True)
    lines[0] = b'{"id": "0", "prompt": "w5 fixed"}\n'  # a line fixed in place
    first.write_bytes(b"".join(lines))
    bj.check_input(first, out)
