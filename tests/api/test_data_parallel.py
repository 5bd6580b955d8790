"""`batchgen run --data-parallel N`: two CPU engines as Ray actors on a local cluster
give the single engine's answers, in input order; a killed engine's shards are rerun."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from test_batch_run import _answers, _chat, _read

from batchgen.api.batch_job import JobOptions
from batchgen.api.cli import main

N_ROWS = 96


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tiny_llama):
    """N_ROWS greedy requests with a bad line, a duplicate and an overlong prompt among
    them, and the single engine's answers to them."""
    d = tmp_path_factory.mktemp("dp")
    rows = [
        _chat(f"r{i}", f"w{3 + i * 7 % 500} w{3 + i * 13 % 500}", max_tokens=24, temperature=0)
        for i in range(N_ROWS)
    ]
    rows[10] = '{"custom_id": "broken", '  # malformed JSON: the driver's error record
    rows[40] = _chat("r3", "w5")  # a duplicate custom_id
    rows[70] = _chat("long", " ".join(["w9"] * 1100))  # the engine refuses it
    inp = d / "in.jsonl"
    inp.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    ref = d / "ref.jsonl"
    assert main(_cli(tiny_llama, inp, ref)) == 1
    return inp, _answers(ref), _error_lines(ref)


def _cli(model: str, inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run", str(inp), "-o", str(out), "--model", model, "--device", "cpu",
        "--kv-cache-gib", "0.02", "--max-num-seqs", "8", *extra,
    ]  # fmt: skip


def _error_lines(out: Path) -> list[int]:
    return [r["error"]["line"] for r in _read(out.with_name(out.stem + ".errors.jsonl"))]


def _input_order(inp: Path) -> list[str]:
    ids = []
    for line in inp.read_text().splitlines():
        try:
            ids.append(json.loads(line)["custom_id"])
        except ValueError:
            continue
    return ids


def test_two_engines_give_the_single_engine_answers_in_input_order(
    tmp_path, tiny_llama, batch, local_ray
):
    inp, expected, expected_errors = batch
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out, "--data-parallel", "2", "--shard-size", "8")) == 1
    assert _answers(out) == expected  # every custom_id once, the same greedy outputs
    written = [r["custom_id"] for r in _read(out)]
    assert written == [c for c in dict.fromkeys(_input_order(inp)) if c in expected]
    assert _error_lines(out) == expected_errors == [11, 41, 71]  # in input order too

    before = out.read_bytes()
    assert main(_cli(tiny_llama, inp, out, "--data-parallel", "2")) == 1  # finished: runs nothing
    assert out.read_bytes() == before


def _engine_pids() -> list[int]:
    """The pids of the live engines. An engine of an earlier job may still be listed
    while Ray tears it down: it answers with an error, and is left out."""
    import ray

    pids = []
    for name in sorted(n for n in ray.util.list_named_actors() if n.startswith("batchgen-engine")):
        try:
            pids.append(ray.get(ray.get_actor(name).ready.remote(), timeout=30))
        except (ValueError, ray.exceptions.RayError):
            continue
    return pids


def _run_killing(out: Path, inp: Path, tiny_llama: str, kill: int, **dp_options):
    """run_data_parallel with 2 engines; SIGKILL `kill` of them once `out` has 4 lines.
    Returns its summary, or the exception it raised."""
    from batchgen.api.data_parallel import DataParallelOptions, run_data_parallel

    killed = threading.Event()

    def kill_engines() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if out.exists() and out.read_bytes().count(b"\n") >= 4:
                pids = _engine_pids()
                if len(pids) >= kill:
                    for pid in pids[:kill]:
                        os.kill(pid, signal.SIGKILL)
                    killed.set()
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_engines, daemon=True)
    watcher.start()
    opts = JobOptions(input=inp, output=out, model_name="tiny", max_in_flight=16, progress=False)
    engine = {"device": "cpu", "kv_cache_size_gib": 0.02, "max_num_seqs": 8}
    dp = DataParallelOptions(
        num_engines=2, model=tiny_llama, engine_kwargs=engine, shard_size=4, **dp_options
    )
    try:
        result = run_data_parallel(opts, dp)
    except Exception as e:
        result = e
    watcher.join()
    assert killed.is_set(), "the job ended before an engine could be killed"
    return result


def test_a_killed_engine_has_its_shards_rerun(tmp_path, tiny_llama, batch, local_ray, caplog):
    """SIGKILL one engine's process part-way: a new engine takes its place, its shards
    run again, and the job ends with every custom_id once and the same answers."""
    inp, expected, expected_errors = batch
    out = tmp_path / "out.jsonl"
    summary = _run_killing(out, inp, tiny_llama, kill=1)
    assert not isinstance(summary, Exception), summary
    assert "its shards go back to the queue and a new engine takes its place" in caplog.text
    assert not summary.interrupted
    assert summary.succeeded + summary.failed == N_ROWS
    assert _answers(out) == expected
    assert _error_lines(out) == expected_errors


def test_when_every_engine_dies_the_job_stops_and_a_rerun_completes(
    tmp_path, tiny_llama, batch, local_ray
):
    """No restarts allowed and both engines killed: the job stops with a clear error
    (never a hang), keeps what it wrote, and a rerun completes it: every custom_id
    once, the whole output in input order."""
    from batchgen.api.data_parallel import DataParallelError

    inp, expected, expected_errors = batch
    out = tmp_path / "out.jsonl"
    error = _run_killing(out, inp, tiny_llama, kill=2, max_restarts=0)
    assert isinstance(error, DataParallelError), error
    assert "every engine died and none may be restarted" in str(error)
    partial = _answers(out)
    assert 4 <= len(partial) < len(expected)

    assert main(_cli(tiny_llama, inp, out, "--data-parallel", "2", "--shard-size", "8")) == 1
    assert _answers(out) == expected
    written = [r["custom_id"] for r in _read(out)]
    assert written == [c for c in dict.fromkeys(_input_order(inp)) if c in expected]
    assert _error_lines(out) == expected_errors


def test_engines_of_two_tensor_parallel_ranks_give_the_single_engine_answers(
    tmp_path, tiny_llama, batch, local_ray, caplog
):
    """--data-parallel 2 --tp 2: each engine is a Ray actor holding two CPUs, its worker
    rank spawned inside it; the answers are the single engine's. More engines than the
    cluster's CPUs hold at two each are refused by name."""
    inp, expected, expected_errors = batch
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out, "--data-parallel", "3", "--tp", "2")) == 2
    assert "3 engines need 6 CPUs (2 each, tensor_parallel_size=2)" in caplog.text
    assert not out.exists()
    extra = ("--data-parallel", "2", "--tp", "2", "--shard-size", "8")
    assert main(_cli(tiny_llama, inp, out, *extra)) == 1
    assert _answers(out) == expected
    assert _error_lines(out) == expected_errors


def test_without_ray_the_flag_says_how_to_install_it(tmp_path, tiny_llama, monkeypatch, caplog):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(_chat("a", "w5")) + "\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out, "--data-parallel", "2")) == 2
    assert "pip install 'batchgen[ray]'" in caplog.text
    assert not out.exists()
