"""`batchgen run --data-parallel 2 --enable-expert-parallel`: one engine of two attention
data-parallel ranks (no Ray) over a batch file, writing the answers one process writes;
the options that do not go with it are refused before anything runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek

from batchgen.api.cli import main

EXIT_USAGE = 2  # batchgen run: a usage error


def _batch(path: Path, n: int = 8) -> Path:
    rng = random.Random(1)
    rows = []
    for i in range(n):
        words = " ".join(f"w{rng.randint(3, 500)}" for _ in range(rng.randint(2, 14)))
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 16}
        rows.append({"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": body})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _answers(path: Path) -> dict[str, tuple]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        choice = rec["response"]["body"]["choices"][0]
        out[rec["custom_id"]] = (choice["message"]["content"], choice["finish_reason"])
    return out


def _run(model: str, inp: Path, out: Path, *extra: str) -> int:
    argv = ["run", str(inp), "-o", str(out), "--model", model, "--device", "cpu"]
    return main([*argv, "--dtype", "float32", "--max-model-len", "128", *extra])


@pytest.mark.slow
def test_run_with_attention_data_parallel_writes_one_processs_answers(tmp_path):
    model = tmp_path / "model"
    save_tiny_deepseek(model, **CONFIGS["moe_dense_first"])
    inp = _batch(tmp_path / "in.jsonl")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert _run(str(model), inp, one, "--temperature", "0") == 0
    dp = ("--data-parallel", "2", "--enable-expert-parallel", "--temperature", "0")
    assert _run(str(model), inp, two, *dp) == 0
    assert _answers(two) == _answers(one)
    assert len(_answers(two)) == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--tp", "2"), "--tp must be 1 for now, got 2"),
        (("--shard-size", "4"), "--shard-size applies to Ray data parallel"),
    ],
)
def test_options_that_do_not_go_with_attention_data_parallel_are_refused(
    tmp_path, caplog, extra, message
):
    inp = _batch(tmp_path / "in.jsonl", 1)
    dp = ("--data-parallel", "2", "--enable-expert-parallel")
    assert _run(str(tmp_path / "none"), inp, tmp_path / "out.jsonl", *dp, *extra) == EXIT_USAGE
    assert message in caplog.text
    assert not (tmp_path / "out.jsonl").exists()
