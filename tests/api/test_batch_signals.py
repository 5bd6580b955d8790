"""`batchgen run` and SIGTERM: the first signal admits nothing more, drops what has not
started, gives the running requests the grace period, and a rerun completes the job."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from test_batch_run import _answers, _chat, _cli, _read, _spawn, _write_jsonl

from batchgen.api.batch_job import JobOptions, run_batch_job
from batchgen.api.cli import main

N_QUEUED = 300
MAX_NUM_SEQS = 16


def _rows(n: int, max_tokens: int) -> list[dict]:
    return [
        _chat(f"q{i}", f"w{3 + i % 500} w{3 + i * 7 % 500}", max_tokens=max_tokens)
        for i in range(n)
    ]


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigterm_stops_admission_and_the_rerun_completes(tmp_path, tiny_llama, caplog):
    """300 queued requests, 16 a step: after SIGTERM at most the running requests
    finish (the old behaviour finished its whole read-ahead, 4 x 16 = 64), the run exits
    3 within the grace period + 10 s, and the rerun (in this process: only the signalled
    run needs one of its own) writes every custom_id once."""
    inp = _write_jsonl(tmp_path / "in.jsonl", _rows(N_QUEUED, max_tokens=24))
    out = tmp_path / "out.jsonl"
    argv = _cli(tiny_llama, inp, out, "--max-num-seqs", str(MAX_NUM_SEQS))
    proc = _spawn(argv)
    deadline = time.monotonic() + 180
    while _lines(out) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, "ended before the signal"
        time.sleep(0.01)
    before = _lines(out)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    took = time.monotonic() - sent
    stderr = proc.stderr.read().decode()
    assert rc == 3, stderr[-2000:]
    assert took < JobOptions.grace_s + 10, f"{took:.1f} s after SIGTERM"
    written = len(_answers(out))  # whole lines only: SIGTERM lets every write end
    assert written - before <= MAX_NUM_SEQS + 8, f"{written - before} lines after SIGTERM"
    assert written < N_QUEUED // 2

    caplog.clear()
    assert main(argv) == 0
    assert f"{written} skipped as already done" in caplog.text
    assert sorted(_answers(out)) == sorted(f"q{i}" for i in range(N_QUEUED))
    assert not (tmp_path / "out.errors.jsonl").exists()


def test_running_requests_are_dropped_when_the_grace_period_ends(tmp_path, tiny_llama):
    """Long requests (ignore_eos) cannot finish within a 0.5 s grace period: the job
    returns soon after it, interrupted, with the short lines written and the long ones
    not; the rerun writes the long ones."""
    from batchgen.api.llm import LLM

    short = [_chat(f"s{i}", f"w{5 + i}", max_tokens=1) for i in range(4)]
    long = [_chat(f"l{i}", f"w{40 + i}", max_tokens=400, ignore_eos=True) for i in range(6)]
    inp = _write_jsonl(tmp_path / "in.jsonl", short + long)
    out = tmp_path / "out.jsonl"
    llm = LLM(model=tiny_llama, device="cpu", kv_cache_size_gib=0.02, max_num_seqs=4)
    opts = JobOptions(inp, out, "tiny", progress=False, grace_s=0.5)

    sent: list[float] = []

    def signal_once_short_lines_are_written() -> None:
        deadline = time.monotonic() + 120
        while _lines(out) < len(short) and time.monotonic() < deadline:
            time.sleep(0.01)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=signal_once_short_lines_are_written)
    thread.start()
    summary = run_batch_job(llm, opts)
    returned = time.monotonic()
    thread.join()
    assert summary.interrupted
    assert returned - sent[0] < 0.5 + 5, f"{returned - sent[0]:.1f} s after SIGTERM"
    assert sorted(_answers(out)) == sorted(f"s{i}" for i in range(4))

    summary = run_batch_job(llm, opts)
    assert not summary.interrupted and summary.succeeded == len(long)
    answers = _answers(out)
    assert sorted(answers) == sorted([*(f"s{i}" for i in range(4)), *(f"l{i}" for i in range(6))])
    assert all(answers[f"l{i}"][2]["completion_tokens"] == 400 for i in range(6))
    assert _read(tmp_path / "out.errors.jsonl") == []
