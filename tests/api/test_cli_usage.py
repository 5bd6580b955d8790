"""The `batchgen` command as a new user meets it: --help without torch, a bad option
named with its value, -i INPUT, Hugging Face ids, OUTPUT's own files refused as input,
the line saying the model is loading, one message for a model --tp cannot split."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hub_offline, save_hub_snapshot, save_tiny_model

import batchgen.api.batch_job as batch_job
from batchgen.api.cli import EXIT_OK, EXIT_USAGE, build_parser, main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def _batchgen(*argv: str) -> subprocess.CompletedProcess:
    code = f"import sys; from batchgen.api.cli import main; sys.exit(main({list(argv)!r}))"
    return _python(code)


def _lines(path: Path, n: int = 2) -> Path:
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"w{5 + i} w9"}], "max_tokens": 3},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_help_version_and_show_import_neither_torch_nor_transformers(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("")
    code = f"""
import contextlib, io, sys
import batchgen
from batchgen.api.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["--help"], ["run", "--help"], ["show", "--help"], ["--version"]):
        assert main(argv) == 0, argv
    assert main(["show", {str(out)!r}]) == 0
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
assert batchgen.LLM.__name__ == "LLM"  # still there, imported on first use
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_lazy_eval_entry_lists_eval_as_the_full_parser_does():
    assert build_parser(lazy_eval=True).format_help() == build_parser().format_help()


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--temperature", "-1", "--temperature must be >= 0, got -1"),
        ("--temperature", "nan", "--temperature must be >= 0, got nan"),
        ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
        ("--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
        ("--kv-cache-gib", "0", "--kv-cache-gib must be > 0, got 0"),
        ("--grace-seconds", "-2.5", "--grace-seconds must be >= 0, got -2.5"),
        ("--device", "gpu", "--device must be auto, cpu, cuda or cuda:N, got gpu"),
        (
            "--enable-expert-parallel",
            "--tp=1",
            "--enable-expert-parallel spreads experts over ranks: it needs --tp > 1, got 1",
        ),
    ],
)
def test_a_bad_value_is_named_with_its_option_in_one_plain_line(tmp_path, option, value, message):
    inp = _lines(tmp_path / "in.jsonl")
    done = _batchgen("run", str(inp), "-o", str(tmp_path / "out.jsonl"), option, value)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [f"batchgen run: error: {message}"]
    assert not (tmp_path / "out.jsonl").exists()


def test_options_are_checked_when_nothing_is_left_to_run(tmp_path):
    inp = tmp_path / "empty.jsonl"
    inp.write_text("")
    out = str(tmp_path / "out.jsonl")
    done = _batchgen("run", str(inp), "-o", out, "--device", "gpu")
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "--device must be auto, cpu, cuda or cuda:N, got gpu" in done.stderr
    done = _batchgen("run", str(inp), "-o", out, "--device", "cpu")
    assert done.returncode == EXIT_OK, done.stderr
    assert "nothing to run (the model was not loaded)" in done.stderr


def test_input_as_option_answers_as_the_positional_does(tmp_path, tiny_llama):
    inp = _lines(tmp_path / "in.jsonl")
    common = ["--model", tiny_llama, "--device", "cpu", "--kv-cache-gib", "0.02"]
    common += ["--temperature", "0"]
    assert main(["run", str(inp), "-o", str(tmp_path / "a.jsonl"), *common]) == EXIT_OK
    assert main(["run", "-i", str(inp), "-o", str(tmp_path / "b.jsonl"), *common]) == EXIT_OK

    def answers(path: Path) -> dict:
        return {
            r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
            for r in _records(path)
        }

    assert answers(tmp_path / "b.jsonl") == answers(tmp_path / "a.jsonl")
    assert len(answers(tmp_path / "a.jsonl")) == 2


def test_the_input_is_given_once(tmp_path, caplog):
    inp = str(_lines(tmp_path / "in.jsonl"))
    out = str(tmp_path / "out.jsonl")
    assert main(["run", inp, "-i", inp, "-o", out]) == EXIT_USAGE
    assert "give the input once" in caplog.text
    assert main(["run", "-o", out]) == EXIT_USAGE
    assert "the input file is missing" in caplog.text


@pytest.mark.parametrize("own", ["out.errors.jsonl", "out.jsonl.lock"])
def test_outputs_own_files_are_refused_as_input(tmp_path, caplog, own):
    """The errors file and the lock are JSONL-looking names beside OUTPUT: a slip of the
    shell's completion; a job would read its own records as requests."""
    given = tmp_path / own
    given.write_text('{"custom_id": "r0", "response": null, "error": {"line": 1}}\n')
    before = given.read_bytes()
    assert main(["run", str(given), "-o", str(tmp_path / "out.jsonl")]) == EXIT_USAGE
    what = "errors file" if own.endswith("errors.jsonl") else "lock file"
    assert f"is the {what} of -o" in caplog.text
    assert given.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


def test_an_output_that_answers_another_input_is_a_usage_error(tmp_path, tiny_llama, caplog):
    """Resuming OUTPUT with an input other than the one its journal answers would skip
    lines by number that never ran: the command refuses it plainly and writes nothing."""
    common = ["--model", tiny_llama, "--device", "cpu", "--kv-cache-gib", "0.02"]
    out = tmp_path / "out.jsonl"
    assert main(["run", str(_lines(tmp_path / "a.jsonl")), "-o", str(out), *common]) == EXIT_OK
    before = out.read_bytes()
    other = tmp_path / "b.jsonl"
    other.write_text((tmp_path / "a.jsonl").read_text().replace("w9", "w8"))
    assert main(["run", str(other), "-o", str(out), *common]) == EXIT_USAGE
    assert "another input" in caplog.text
    assert "Traceback" not in caplog.text
    assert out.read_bytes() == before


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_llama):
    """HF_HUB_CACHE holding "acme/tiny-llama" in the hub's layout; offline."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    save_hub_snapshot(tmp_path / "hub", "acme/tiny-llama", tiny_llama, commit)
    hub_offline(monkeypatch, tmp_path / "hub")


def test_a_hugging_face_id_runs_from_the_local_cache(tmp_path, tiny_llama, hub_cache, caplog):
    inp = _lines(tmp_path / "in.jsonl")
    common = ["--device", "cpu", "--kv-cache-gib", "0.02", "--temperature", "0"]
    by_id, by_path = tmp_path / "id.jsonl", tmp_path / "path.jsonl"
    assert main(["run", str(inp), "-o", str(by_id), "--model", "acme/tiny-llama", *common]) == 0
    assert main(["run", str(inp), "-o", str(by_path), "--model", tiny_llama, *common]) == 0
    got, want = _records(by_id), _records(by_path)
    assert {r["response"]["body"]["model"] for r in got} == {"acme/tiny-llama"}

    def texts(records: list[dict]) -> dict:
        return {r["custom_id"]: r["response"]["body"]["choices"][0] for r in records}

    assert texts(got) == texts(want)
    missing = ["run", str(inp), "-o", str(tmp_path / "m.jsonl"), "--model", "acme/missing"]
    assert main([*missing, *common]) == EXIT_USAGE
    assert "could not load model acme/missing" in caplog.text
    assert "'acme/missing' is not a local path, not in the Hugging Face cache" in caplog.text


def test_the_model_loading_is_said_before_any_result(tmp_path, tiny_llama, caplog, monkeypatch):
    inp = _lines(tmp_path / "in.jsonl")
    seen = []
    real = batch_job.run_batch_job

    def job(llm, opts):
        seen.append((opts.seed, opts.grace_s))
        return real(llm, opts)

    monkeypatch.setattr(batch_job, "run_batch_job", job)
    argv = ["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", tiny_llama]
    assert main([*argv, "--device", "cpu", "--kv-cache-gib", "0.02", "--grace-seconds", "2.5"]) == 0
    loading = [r for r in caplog.records if r.getMessage().startswith("loading ")]
    assert len(loading) == 1
    assert loading[0].getMessage().startswith(f"loading {Path(tiny_llama).name} on cpu;")
    assert caplog.records.index(loading[0]) < caplog.records.index(
        next(r for r in caplog.records if r.getMessage().startswith("done: "))
    )
    assert seen == [(0, 2.5)]  # --seed defaults to 0; the grace reaches the job


def test_a_model_tp_cannot_split_is_one_message_and_no_worker(tmp_path, capfd, caplog):
    """3 KV heads over 2 ranks: refused before a worker is spawned, so no worker's
    traceback precedes the message."""
    model = tmp_path / "model"
    save_tiny_model(
        model, "LlamaForCausalLM", hidden_size=48, num_attention_heads=6, num_key_value_heads=3
    )
    inp = _lines(tmp_path / "in.jsonl")
    argv = ["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", str(model)]
    code = main([*argv, "--device", "cpu", "--kv-cache-gib", "0.02", "--tp", "2"])
    assert code == EXIT_USAGE
    assert "num_key_value_heads=3 is not divisible by tensor_parallel_size=2" in caplog.text
    assert "Traceback" not in capfd.readouterr().err
    assert multiprocessing.active_children() == []
