"""`batchgen run --data-parallel 2 --enable-expert-parallel`: one engine of two attention
data-parallel ranks (no Ray) over a batch file, writing the answers one process writes;
the options that do not go with it are refused before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from batch_files import read_answers, write_chat_batch
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek

from batchgen.api.cli import main

EXIT_USAGE = 2  # batchgen run: a usage error


def _run(model: str, inp: Path, out: Path, *extra: str) -> int:
    argv = ["run", str(inp), "-o", str(out), "--model", model, "--device", "cpu"]
    return main([*argv, "--dtype", "float32", "--max-model-len", "128", *extra])


@pytest.mark.slow
def test_run_with_attention_data_parallel_writes_one_processs_answers(tmp_path):
    model = tmp_path / "model"
    save_tiny_deepseek(model, **CONFIGS["moe_dense_first"])
    inp = write_chat_batch(tmp_path / "in.jsonl", 8, max_tokens=16)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert _run(str(model), inp, one, "--temperature", "0") == 0
    dp = ("--data-parallel", "2", "--enable-expert-parallel", "--temperature", "0")
    assert _run(str(model), inp, two, *dp) == 0
    assert read_answers(two) == read_answers(one)
    assert len(read_answers(two)) == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--tp", "2"), "--tp must be 1 for now, got 2"),
        (("--tp", "2"), "for 4 ranks use --data-parallel 4 --enable-expert-parallel"),
        (("--shard-size", "4"), "--shard-size applies to Ray data parallel"),
    ],
)
def test_options_that_do_not_go_with_attention_data_parallel_are_refused(
    tmp_path, caplog, extra, message
):
    inp = write_chat_batch(tmp_path / "in.jsonl", 1, max_tokens=16)
    dp = ("--data-parallel", "2", "--enable-expert-parallel")
    assert _run(str(tmp_path / "none"), inp, tmp_path / "out.jsonl", *dp, *extra) == EXIT_USAGE
    assert message in caplog.text
    assert not (tmp_path / "out.jsonl").exists()
