"""What the `batchgen` command prints: --version, and a run's stdout and stderr (its own
logs and summary by default, errors only under --quiet, never other libraries' noise)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import save_tiny_model

from batchgen.api.cli import EXIT_OK, EXIT_USAGE, main
from batchgen.models.default_model import DEFAULT_GGUF, default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
# batchgen's own log lines: "2026-01-01 12:00:00,000 INFO batchgen.api.cli: done: ..."
OWN_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) batchgen\.")


def _batchgen(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["OMP_NUM_THREADS"] = "1"  # small models: one thread is as fast, and robust to a busy CPU
    return subprocess.run(
        [sys.executable, "-m", "batchgen", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version_prints_the_package_metadata_version(capsys):
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out == f"batchgen {metadata.version('batchgen')}\n"


def test_version_is_not_a_usage_error_from_the_command_line():
    done = _batchgen("--version", timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"batchgen {metadata.version('batchgen')}"
    assert done.stderr == ""


@pytest.fixture(scope="module")
def noisy(tmp_path_factory) -> str:
    """A tiny model whose tokenizer makes transformers warn on every decode (a BPE
    tokenizer asking for clean_up_tokenization_spaces, as some published ones do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("noisy")
    save_tiny_model(path, "LlamaForCausalLM")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        clean_up_tokenization_spaces=True,
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return str(path)


def _input(path: Path, n: int = 2) -> Path:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "w5 w6"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(model: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return _batchgen(
        "run", str(_input(tmp_path / "in.jsonl")), "-o", str(tmp_path / "out.jsonl"),
        "--model", model, "--device", "cpu", "--kv-cache-gib", "0.02", "--max-tokens", "4",
        *extra,
    )  # fmt: skip


def _on_a_terminal(*argv: str, timeout: float = 300) -> tuple[int, str]:
    """Run `batchgen ARGV` with stdout and stderr on a pseudo-terminal 120 columns wide;
    returns the exit code and everything it wrote there."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_the_progress_bar_shows_and_quiet_removes_it(tmp_path, noisy):
    inp = str(_input(tmp_path / "in.jsonl"))
    common = ["--model", noisy, "--device", "cpu", "--kv-cache-gib", "0.02", "--max-tokens", "4"]
    rc, shown = _on_a_terminal("run", inp, "-o", str(tmp_path / "a.jsonl"), *common)
    assert rc == EXIT_OK, shown[-2000:]
    assert "batch:" in shown and "req" in shown
    rc, shown = _on_a_terminal("run", inp, "-o", str(tmp_path / "b.jsonl"), *common, "--quiet")
    assert rc == EXIT_OK, shown[-2000:]
    assert shown == ""


def _foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not OWN_LOG.match(line)]


def test_a_run_prints_only_batchgen_logs_and_the_summary(tmp_path, noisy):
    done = _run(noisy, tmp_path)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    assert done.stdout == ""
    assert _foreign_lines(done.stderr) == []
    assert "done: 2 succeeded" in done.stderr.splitlines()[-1]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


def test_quiet_prints_nothing_on_success(tmp_path, noisy):
    done = _run(noisy, tmp_path, "--quiet")
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    assert (done.stdout, done.stderr) == ("", "")
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


def test_quiet_still_prints_errors(tmp_path):
    """A usage error reads as argparse's own: the command, `error:`, no log prefix."""
    missing = tmp_path / "no-such-model"
    done = _run(str(missing), tmp_path, "--quiet")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        f"batchgen run: error: --model {missing} not found: no such file or directory, nor "
        "a Hugging Face id (org/name)"
    ]


def test_in_process_main_puts_logging_back(tmp_path, noisy):
    """main() may run inside another program: the levels it set are restored."""
    import logging

    from transformers.utils import logging as hf_logging

    before = (logging.getLogger().level, logging.getLogger("batchgen").level)
    hf_before = hf_logging.get_verbosity()
    argv = ["run", str(_input(tmp_path / "in.jsonl")), "-o", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--model", noisy, "--kv-cache-gib", "0.02", "--quiet"]) == EXIT_OK
    assert (logging.getLogger().level, logging.getLogger("batchgen").level) == before
    assert hf_logging.get_verbosity() == hf_before


DEFAULT_GGUF_PATH = default_cache_dir() / DEFAULT_GGUF


@pytest.mark.slow
@pytest.mark.skipif(
    not DEFAULT_GGUF_PATH.is_file(), reason="the default model is not cached (no network in tests)"
)
def test_the_readme_command_on_the_default_model_prints_no_library_noise(tmp_path):
    """The README's first command (one of its requests, a few tokens: a CPU is slow): no
    deprecation warning, no GGUF de-quantization bar when stderr is not a terminal; a
    line saying the model loads; `batchgen show` prints the answer."""
    first = (ROOT / "examples" / "chat_batch.jsonl").read_text().splitlines()[0]
    inp = tmp_path / "in.jsonl"
    inp.write_text(first + "\n")
    done = _batchgen(
        "run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--device", "cpu",
        "--max-tokens", "2", "--max-model-len", "256", "--kv-cache-gib", "0.02",
    )  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    assert done.stdout == ""
    assert _foreign_lines(done.stderr) == []
    assert "loading the default model SmolLM2-135M-Instruct on cpu" in done.stderr
    assert "done: 1 succeeded" in done.stderr
    # the command's last part: the answer as people read it
    shown = _batchgen("show", str(tmp_path / "out.jsonl"), timeout=120)
    assert (shown.returncode, shown.stderr) == (EXIT_OK, "")
    (record,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    choice = record["response"]["body"]["choices"][0]
    answer = choice["message"]["content"].strip()
    assert shown.stdout.splitlines()[0] == (
        f"{json.loads(first)['custom_id']} ({choice['finish_reason']}): {answer}"
    )
    # on a terminal the de-quantization bar still shows
    rc, shown = _on_a_terminal(
        "run", str(inp), "-o", str(tmp_path / "tty.jsonl"), "--device", "cpu",
        "--max-tokens", "2", "--max-model-len", "256", "--kv-cache-gib", "0.02",
    )  # fmt: skip
    assert rc == EXIT_OK, shown[-2000:]
    assert "Converting and de-quantizing GGUF tensors" in shown


def test_shard_size_without_data_parallel_is_a_usage_error(tmp_path, caplog):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "w5"}\n')
    code = main(["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--shard-size", "8"])
    assert code == 2
    assert "--shard-size applies to --data-parallel runs only" in caplog.text
    assert not (tmp_path / "out.jsonl").exists()


def test_tp_splits_the_model_over_processes_and_answers_as_one(tmp_path, caplog):
    """--tp 2 on the CPU: two gloo ranks, the same greedy answers as one process, and the
    worker gone when the command returns; --tp 0 is a usage error."""
    import multiprocessing

    from test_batch_run import _answers, _chat

    model = tmp_path / "model"
    save_tiny_model(model, "LlamaForCausalLM")
    inp = tmp_path / "in.jsonl"
    rows = [
        _chat(f"r{i}", f"w{5 + i} w{9 + 2 * i}", max_tokens=12, temperature=0) for i in range(8)
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["run", str(inp), "--model", str(model), "--device", "cpu", "--kv-cache-gib", "0.02"]
    assert main([*base, "-o", str(tmp_path / "one.jsonl")]) == EXIT_OK
    assert main([*base, "-o", str(tmp_path / "two.jsonl"), "--tp", "2"]) == EXIT_OK
    one = _answers(tmp_path / "one.jsonl")
    assert len(one) == 8 and _answers(tmp_path / "two.jsonl") == one
    assert multiprocessing.active_children() == []  # the worker left with the job
    assert main([*base, "-o", str(tmp_path / "bad.jsonl"), "--tp", "0"]) == EXIT_USAGE
    assert "--tp must be >= 1, got 0" in caplog.text
