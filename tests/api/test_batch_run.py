"""`batchgen run`: kill-and-resume, bad lines, torn lines, usage errors, bounded memory."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model

from batchgen.api.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
N_KILL = 150  # the kill lands after 20 answers, with seconds of the run still to go


def _chat(cid: str, words: str, **body) -> dict:
    body = {"messages": [{"role": "user", "content": words}], **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _greedy_chats(n: int, seed: int, words: tuple[int, int], max_tokens: int) -> list[dict]:
    """n greedy chat lines r0..r{n-1} of random "wN" words (a count in `words`)."""
    rng = random.Random(seed)
    return [
        _chat(
            f"r{i}",
            " ".join(f"w{rng.randint(3, 511)}" for _ in range(rng.randint(*words))),
            max_tokens=max_tokens,
            temperature=0,
        )
        for i in range(n)
    ]


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _read(path: Path, torn_ok: bool = False) -> list[dict]:
    """The file's records. torn_ok: a last line cut short (no newline: a run killed by
    SIGKILL inside its write) is left out; any other line must be whole JSON."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    last = lines.pop()  # b"" after a final newline
    assert torn_ok or not last, f"a torn last line: {last[-200:]!r}"
    return [json.loads(line) for line in lines]


def _answers(path: Path, torn_ok: bool = False) -> dict[str, tuple]:
    """custom_id -> (text, finish_reason, usage); fails on a duplicate custom_id."""
    out: dict[str, tuple] = {}
    for rec in _read(path, torn_ok):
        assert rec["custom_id"] not in out, f"duplicate {rec['custom_id']}"
        body = rec["response"]["body"]
        choice = body["choices"][0]
        out[rec["custom_id"]] = (
            choice["message"]["content"],
            choice["finish_reason"],
            body["usage"],
        )
    return out


def _cli(model: str, inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run", str(inp), "-o", str(out), "--model", model, "--device", "cpu",
        "--kv-cache-gib", "0.02", *extra,
    ]  # fmt: skip


def _spawn(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["OMP_NUM_THREADS"] = "1"  # a tiny model: one thread is as fast, and robust to a busy CPU
    return subprocess.Popen(
        [sys.executable, "-m", "batchgen", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.fixture(scope="module")
def kill_input(tmp_path_factory, tiny_llama):
    """N_KILL greedy chat requests and their answers from one uninterrupted run (in this
    process: only the killed runs need processes of their own)."""
    d = tmp_path_factory.mktemp("kill")
    inp = _write_jsonl(d / "in.jsonl", _greedy_chats(N_KILL, seed=0, words=(1, 12), max_tokens=64))
    ref = d / "ref.jsonl"
    assert main(_cli(tiny_llama, inp, ref, "--max-num-seqs", "8")) == 0
    answers = _answers(ref)
    assert len(answers) == N_KILL
    return inp, answers


def _kill_part_way(proc: subprocess.Popen, out: Path, sig: int) -> None:
    """Send `sig` once `out` holds some lines but not all."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 20:
            proc.send_signal(sig)
            return
        time.sleep(0.02)
    pytest.fail(
        f"the run ended (rc={proc.returncode}) or stalled before it could be killed: "
        f"{proc.stderr.read().decode()[-2000:]}"
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, tiny_llama, kill_input, sig):
    inp, expected = kill_input
    out = tmp_path / "out.jsonl"
    argv = _cli(tiny_llama, inp, out, "--max-num-seqs", "8")
    proc = _spawn(argv)
    _kill_part_way(proc, out, sig)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read().decode()
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
    else:
        assert rc == 3, stderr[-2000:]
        assert "Rerun the same command to resume" in stderr
    # a write() that SIGKILL interrupts may leave its last line torn (the kernel stops
    # between pages); the rerun repairs it. SIGTERM lets the run finish its lines.
    partial = _answers(out, torn_ok=sig == signal.SIGKILL)
    assert 20 <= len(partial) < N_KILL, "the kill should land part-way"

    proc = _spawn(argv)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read().decode()
    assert rc == 0, stderr[-2000:]
    assert f"{len(partial)} skipped as already done" in stderr
    assert _answers(out) == expected  # every custom_id once, the same greedy outputs
    assert not (tmp_path / "out.errors.jsonl").exists()


def test_bad_lines_get_error_records_and_good_lines_complete(tmp_path, tiny_llama):
    good = {f"g{i}": _chat(f"g{i}", f"w{10 + i} w20", max_tokens=4) for i in range(6)}
    bad = [  # (line, expected reason)
        ('{"custom_id": "x1", "method": "POST", "url": ', "malformed JSON"),
        (_chat(None, "w5"), "missing custom_id"),
        (_chat("g0", "w5 w6"), "duplicate custom_id 'g0': already answered by line 1"),
        ({**_chat("x2", "w5"), "custom_id": 17}, "custom_id must be a non-empty string"),
        (_chat("x3", "w5", max_tokens="ten"), "max_tokens must be an integer"),
        (_chat("x4", "w5", temperature="hot"), "temperature must be a number"),
        ({**_chat("x5", "w5"), "url": "/v1/embeddings"}, "unknown url '/v1/embeddings'"),
        ({**_chat("x6", "w5"), "body": {"messages": []}}, "body.messages is empty"),
        ({**_chat("x7", "w5"), "body": {"messages": "w5"}}, "body.messages must be a list"),
        (_chat("x8", " ".join(["w9"] * 1100)), "max_model_len is 1024"),
        (b'{"custom_id": "x9", "prompt": "w5 \xff\xfe"}', "not valid UTF-8"),
        ("", "the line is blank"),
        ("   ", "the line is blank"),
        ({**_chat("x10", "w5"), "method": "GET"}, 'method must be "POST"'),
        ({**_chat("x11", "w5"), "body": [1]}, "body must be a JSON object"),
        ("[1, 2]", "expected a JSON object"),
        (_chat("x12", "w5", top_logprobs=2), "top_logprobs needs body.logprobs"),
        ({"id": "x13", "prompt": ""}, "the prompt is empty"),
        ({"id": "x14", "prompt": 5}, "body.prompt must be a string"),
        (
            {**_chat("x15", "w5"), "body": {"messages": [{"role": "bot", "content": "w5"}]}},
            "body.messages[0].role must be one of system, user, assistant, developer, got 'bot'",
        ),
        (_chat("x16", "w5", logprobs=True, top_logprobs=21), "body.top_logprobs must be"),
    ]
    rows: list = []
    for i, (line, _) in enumerate(bad):
        rows.append(good[f"g{i}"] if i < len(good) else _chat(f"h{i}", "w30", max_tokens=2))
        rows.append(line)
    inp = tmp_path / "in.jsonl"
    with open(inp, "wb") as f:
        for row in rows:
            f.write(
                row
                if isinstance(row, bytes)
                else (row if isinstance(row, str) else json.dumps(row)).encode()
            )
            f.write(b"\n")
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out)) == 1

    done = _answers(out)
    good_ids = {r["custom_id"] for r in rows[::2]}
    assert set(done) == good_ids
    errors = _read(tmp_path / "out.errors.jsonl")
    assert [e["error"]["line"] for e in errors] == list(range(2, 2 * len(bad) + 1, 2))
    for (_, reason), rec in zip(bad, errors):
        assert rec["response"] is None and rec["error"]["code"] == "invalid_request"
        assert rec["error"]["message"].startswith(f"line {rec['error']['line']}: ")
        assert reason in rec["error"]["message"], rec["error"]["message"]

    before = out.read_bytes(), (tmp_path / "out.errors.jsonl").read_bytes()
    assert main(_cli(tiny_llama, inp, out)) == 1  # a rerun writes nothing new
    assert (out.read_bytes(), (tmp_path / "out.errors.jsonl").read_bytes()) == before


def test_duplicate_custom_id_names_the_line_that_answered_it(tmp_path, tiny_llama):
    rows = [
        _chat("a", "w5", max_tokens=2),  # line 1
        _chat("b", "w6", max_tokens=2),
        _chat("a", "w7", max_tokens=2),  # 3: a duplicate of line 1
        {**_chat("z", "w5"), "body": {"messages": []}},  # 4: a bad line
        _chat("z", "w8", max_tokens=2),  # 5: a duplicate of line 4, answered by its error
        _chat("a", "w9", max_tokens=2),  # 6: a duplicate of line 1 again
    ]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    assert main(_cli(tiny_llama, inp, out)) == 1
    assert sorted(_answers(out)) == ["a", "b"]
    errors = {e["error"]["line"]: e for e in _read(err)}
    assert sorted(errors) == [3, 4, 5, 6]
    assert "duplicate_of_line" not in errors[4]["error"]
    for line, first in ((3, 1), (5, 4), (6, 1)):
        rec = errors[line]["error"]
        assert rec["duplicate_of_line"] == first
        assert rec["message"].startswith(f"line {line}: duplicate custom_id ")
        assert f"already answered by line {first}, whose answer stands" in rec["message"]
        assert "this line was not run" in rec["message"]

    before = out.read_bytes(), err.read_bytes()
    assert main(_cli(tiny_llama, inp, out)) == 1  # a rerun keeps the first answers, adds nothing
    assert (out.read_bytes(), err.read_bytes()) == before


def test_rerun_of_a_finished_job_does_not_load_the_model(tmp_path, tiny_llama, monkeypatch, caplog):
    import batchgen.api.llm as llm_module

    rows = [_chat(f"f{i}", f"w{20 + i}", max_tokens=2) for i in range(4)]
    rows.append(_chat("f0", "w30", max_tokens=2))  # a duplicate: answered by an error record
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    assert main(_cli(tiny_llama, inp, out)) == 1
    before = out.read_bytes(), err.read_bytes()

    loads = []
    real_llm = llm_module.LLM

    def counting_llm(*args, **kwargs):
        loads.append(kwargs)
        return real_llm(*args, **kwargs)

    monkeypatch.setattr(llm_module, "LLM", counting_llm)
    caplog.clear()
    assert main(_cli(tiny_llama, inp, out)) == 1  # the earlier failure still counts
    assert loads == []
    assert "nothing to run (the model was not loaded)" in caplog.text
    assert "0 succeeded, 0 failed (+1 in earlier runs), 4 skipped as already done" in caplog.text
    assert (out.read_bytes(), err.read_bytes()) == before

    _write_jsonl(inp, [*rows, _chat("f5", "w31", max_tokens=2)])  # one line left to run
    assert main(_cli(tiny_llama, inp, out)) == 1
    assert len(loads) == 1
    assert sorted(_answers(out)) == ["f0", "f1", "f2", "f3", "f5"]

    _write_jsonl(inp, [r for r in rows if r is not rows[-1]] + [_chat("f5", "w31")])
    err.unlink()  # the duplicate line is gone: every line now has its answer in OUTPUT
    caplog.clear()
    assert main(_cli(tiny_llama, inp, out)) == 0
    assert len(loads) == 1
    assert "0 succeeded, 0 failed, 5 skipped as already done" in caplog.text


def test_a_second_run_on_a_locked_output_is_refused(tmp_path, tiny_llama, monkeypatch, caplog):
    import fcntl

    import batchgen.api.llm as llm_module

    inp = _write_jsonl(tmp_path / "in.jsonl", [_chat("a", "w5", max_tokens=2)])
    out = tmp_path / "out.jsonl"
    loads = []
    real_llm = llm_module.LLM
    monkeypatch.setattr(llm_module, "LLM", lambda *a, **k: loads.append(1) or real_llm(*a, **k))
    with open(tmp_path / "out.jsonl.lock", "a+") as held:  # another run's lock, own descriptor
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(_cli(tiny_llama, inp, out)) == 2
        assert f"another batchgen run is writing to {out}" in caplog.text
        assert loads == [] and not out.exists()
        linked = tmp_path / "link"
        linked.symlink_to(tmp_path)  # the same output under another path
        assert main(_cli(tiny_llama, inp, linked / "out.jsonl")) == 2
        assert loads == [] and not out.exists()
    assert main(_cli(tiny_llama, inp, out)) == 0  # the lock is free again
    assert list(_answers(out)) == ["a"]


def test_two_concurrent_runs_write_each_answer_once(tmp_path, tiny_llama, kill_input, caplog):
    inp, expected = kill_input
    out = tmp_path / "out.jsonl"
    argv = _cli(tiny_llama, inp, out, "--max-num-seqs", "8")
    first = _spawn(argv)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 20):
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended early"
        time.sleep(0.02)
    assert main(argv) == 2  # refused while the first run holds the output
    assert f"another batchgen run is writing to {out} (process {first.pid})" in caplog.text
    assert first.poll() is None, "the first run should still be going"
    assert first.wait(timeout=120) == 0, first.stderr.read().decode()[-2000:]
    assert _answers(out) == expected  # every custom_id once


def test_full_disk_stops_with_a_message_and_a_rerun_completes(
    tmp_path, tiny_llama, monkeypatch, caplog
):
    import errno

    from batchgen.api.batch_journal import Appender

    rows = [_chat(f"d{i}", f"w{60 + i} w7", max_tokens=4, temperature=0) for i in range(24)]
    rows.insert(3, _chat("d0", "w5"))  # a duplicate, for an error record
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, ref, "--max-num-seqs", "4")) == 1
    expected = _answers(ref)

    real_write = Appender._write

    def full_disk(self, data: bytes) -> None:
        """Write some results, then half a line, then fail as a full disk does."""
        if self.path == out and out.exists() and out.read_bytes().count(b"\n") >= 8:
            real_write(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, data)

    monkeypatch.setattr(Appender, "_write", full_disk)
    caplog.clear()
    assert main(_cli(tiny_llama, inp, out, "--max-num-seqs", "4")) == 4
    written = len(_read_whole(out))
    assert 8 <= written < 24 and not out.read_bytes().endswith(b"\n")  # a torn last line
    text = caplog.text
    assert "Traceback" not in text
    assert f"the disk is full ([Errno 28] No space left on device: '{out}')" in text
    assert f"Safely written: {written} results in {out} and 1 error records" in text
    assert "rerun the same command to resume" in text

    monkeypatch.undo()
    caplog.clear()
    assert main(_cli(tiny_llama, inp, out, "--max-num-seqs", "4")) == 1
    assert f"{written} skipped as already done" in caplog.text
    assert _answers(out) == expected  # every custom_id once, the uninterrupted answers
    assert len(_read(tmp_path / "out.errors.jsonl")) == 1


def _read_whole(path: Path) -> list[dict]:
    """The whole lines of a file that may end in a torn one."""
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def test_torn_last_line_is_repaired(tmp_path, tiny_llama):
    rows = [_chat(f"t{i}", f"w{40 + i}", max_tokens=3, temperature=0) for i in range(5)]
    rows.append({"id": "p", "prompt": "w7 w8", "max_tokens": 3, "temperature": 0, "logprobs": 2})
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, ref)) == 0
    lines = ref.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # a torn write
    assert main(_cli(tiny_llama, inp, out)) == 0
    recs = _read(out)
    assert sorted(r["custom_id"] for r in recs) == sorted(r.get("custom_id", "p") for r in rows)
    by_id = {r["custom_id"]: r["response"]["body"] for r in recs}
    expected = {r["custom_id"]: _same_run(r["response"]["body"], True) for r in _read(ref)}
    assert {k: _same_run(v) for k, v in by_id.items()} == expected
    completion = by_id["p"]
    assert completion["object"] == "text_completion"
    assert len(completion["choices"][0]["logprobs"]["token_logprobs"]) == 3
    assert completion["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def _same_run(body: dict, approx: bool = False) -> dict:
    """The parts of an output body that a rerun reproduces (logprobs to 1e-4: the batch
    around a request changes float rounding)."""
    choices = []
    for c in body["choices"]:
        lp = c["logprobs"]
        if lp is not None:
            vals = (
                lp["token_logprobs"]
                if "token_logprobs" in lp
                else [t["logprob"] for t in lp["content"]]
            )
            lp = {
                "tokens": lp.get("tokens"),
                "values": pytest.approx(vals, abs=1e-4) if approx else vals,
            }
        choices.append({**c, "logprobs": lp})
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "choices": choices}


def test_usage_errors_fail_at_once(tmp_path, tiny_llama, caplog):
    inp = _write_jsonl(tmp_path / "in.jsonl", [_chat("a", "w5")])
    assert main(["run", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "does not exist" in caplog.text
    assert (
        main(
            [
                "run",
                str(inp),
                "-o",
                str(tmp_path / "o.jsonl"),
                "--model",
                str(tmp_path / "no-model"),
            ]
        )
        == 2
    )
    assert "not found" in caplog.text
    assert main(["run", str(inp)]) == 2  # no -o
    assert main(_cli(tiny_llama, inp, tmp_path / "o.jsonl", "--max-tokens", "0")) == 2
    assert main(_cli(tiny_llama, inp, tmp_path / "o.jsonl", "--host-kv-gib", "-1")) == 2
    assert "--host-kv-gib must be >= 0" in caplog.text
    assert not (tmp_path / "o.jsonl").exists()


def test_seed_makes_sampled_outputs_reproducible(tmp_path, tiny_llama):
    """With --seed, a sampled request's output depends on its custom_id only, not on the
    batch around it, so a resumed job samples what an uninterrupted one would."""
    rows = [_chat(f"s{i}", f"w{50 + i} w60", max_tokens=8, ignore_eos=True) for i in range(12)]
    rows.append(
        {
            "id": "plain",
            "messages": [{"role": "user", "content": "w70"}],
            "seed": 3,
            "max_tokens": 8,
        }
    )
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    a, b, c = (tmp_path / f"{x}.jsonl" for x in "abc")
    assert main(_cli(tiny_llama, inp, a, "--seed", "7", "--max-num-seqs", "2")) == 0
    assert main(_cli(tiny_llama, inp, b, "--seed", "7", "--max-num-seqs", "16")) == 0
    assert main(_cli(tiny_llama, inp, c, "--seed", "8", "--max-num-seqs", "16")) == 0
    assert _answers(a) == _answers(b)
    differs = [k for k, v in _answers(c).items() if v != _answers(a)[k]]
    assert set(differs) == {f"s{i}" for i in range(12)}, differs  # "plain" has its own seed


def _peak_rss_mib(argv: list[str]) -> float:
    proc = _spawn(argv)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    return usage.ru_maxrss / 1024  # KiB on Linux


@pytest.mark.slow
def test_memory_stays_bounded_on_a_large_input(tmp_path, tiny_llama):
    """Peak RSS with 100k requests stays within a few MiB of the peak with 10k.

    Both peaks include the model and the KV pool; what may grow is the set of custom_ids
    seen (~6 MiB for 100k). Holding the input's lines or results would add well over
    100 MiB (100k parsed requests or output lines at >1 KiB each)."""

    def make(n: int) -> Path:
        path = tmp_path / f"in{n}.jsonl"
        with open(path, "w") as f:
            for i in range(n):
                body = {"prompt": f"w{3 + i % 500} w{3 + i * 7 % 500}", "max_tokens": 1}
                row = {
                    "custom_id": f"m{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": body,
                }
                f.write(json.dumps(row) + "\n")
        return path

    small = _peak_rss_mib(_cli(tiny_llama, make(10_000), tmp_path / "o10k.jsonl"))
    large = _peak_rss_mib(_cli(tiny_llama, make(100_000), tmp_path / "o100k.jsonl"))
    assert sum(1 for _ in open(tmp_path / "o100k.jsonl")) == 100_000
    assert large < small + 50, f"peak RSS {small:.0f} MiB (10k lines) -> {large:.0f} MiB (100k)"


def test_response_format_answers_validate_and_bad_schemas_are_line_errors(tmp_path):
    """OpenAI's response_format in a batch file, run with the defaults: every answer
    parses and validates; a schema that does not compile is an error record naming
    the request, and the other lines complete."""
    import jsonschema
    from conftest import save_byte_tokenizer

    model = tmp_path / "model"
    save_tiny_model(model, "LlamaForCausalLM")
    save_byte_tokenizer(model)  # the grammar can spell JSON with it
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "boolean"},
        },
        "required": ["n", "b"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "row", "schema": schema, "strict": True}}
    rows = [_chat(f"r{i}", f"row {i}", response_format=fmt, max_tokens=120) for i in range(6)]
    rows.append(
        _chat(
            "bad",
            "x",
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        )
    )
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(_cli(str(model), inp, out, "--temperature", "1.0")) == 1  # a line failed
    answers = _answers(out)
    assert sorted(answers) == [f"r{i}" for i in range(6)]
    for text, reason, _ in answers.values():
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)
    errors = _read(out.with_name("out.errors.jsonl"))
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert "does not compile" in json.dumps(errors[0])


def test_host_tier_from_the_command_line_swaps_and_changes_no_answer(tmp_path, tiny_llama):
    """--host-kv-gib turns the host tier on: with a device pool too small for the batch,
    preempted requests are swapped to host and back (the summary says so; one with less
    than a page computed is recomputed) and every
    greedy answer equals an ample-pool run's. Defaults otherwise (EOS endings, pipeline)."""
    inp = _write_jsonl(
        tmp_path / "in.jsonl", _greedy_chats(12, seed=3, words=(4, 12), max_tokens=40)
    )
    ample, tight = tmp_path / "ample.jsonl", tmp_path / "tight.jsonl"
    common = ["--max-num-seqs", "8", "--max-model-len", "96"]
    assert main(_cli(tiny_llama, inp, ample, *common)) == 0
    argv = _cli(tiny_llama, inp, tight, *common)
    argv[argv.index("--kv-cache-gib") + 1] = "0.00006"  # 15 pages of 16 tokens
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", *argv, "--host-kv-gib", "0.001"],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    swapped = re.search(
        r"KV: (\d+) preemptions \((\d+) swapped to host, (\d+) recomputed\)",
        done.stderr + done.stdout,
    )
    assert swapped, done.stderr[-2000:]
    preemptions, swaps, recomputes = map(int, swapped.groups())
    # a request preempted before it has one full page computed has nothing to swap
    assert swaps > 0 and swaps + recomputes == preemptions
    assert _answers(tight) == _answers(ample)


def test_kv_cache_dtype_fp8_reaches_the_engine(tmp_path, tiny_llama, monkeypatch):
    import batchgen.api.llm as llm_module

    inp = _write_jsonl(tmp_path / "in.jsonl", [_chat("a", "w5", max_tokens=3)])
    out = tmp_path / "out.jsonl"
    engines = []
    real_llm = llm_module.LLM

    def keep(*args, **kwargs):
        llm = real_llm(*args, **kwargs)
        engines.append(llm.engine)
        return llm

    monkeypatch.setattr(llm_module, "LLM", keep)
    assert main(_cli(tiny_llama, inp, out, "--kv-cache-dtype", "fp8")) == 0
    assert engines[0].config.kv_cache_dtype == "fp8"
    assert engines[0].pool.kv.dtype == torch.float8_e4m3fn
    assert list(_answers(out)) == ["a"]
