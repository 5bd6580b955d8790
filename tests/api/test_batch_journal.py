"""batch_journal: the output lock, the writer on a full disk, counting whole records."""

from __future__ import annotations

import errno
import os

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
