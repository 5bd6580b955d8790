"""docs/plan.md's fit table is `batchgen plan`'s output: every "$ batchgen plan ..."
block of the page is run again and must print what the page shows, so the table cannot
drift from the code. The page covers DeepSeek-V3, Kimi-K2, Kimi-K2-Thinking and
Kimi-Linear-48B at 8 and 16 H200s, and its weights add up to what the models ship."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from batchgen.api.cli import main

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "plan.md"
# a command block, then its output up to the next command block or heading
BLOCK = re.compile(r"```\n\$ batchgen (plan [^\n]+)\n```\n(.*?)(?=\n```\n\$ |\n#+ |\Z)", re.S)
MODELS = ("deepseek-v3", "kimi-k2-instruct", "kimi-k2-thinking", "kimi-linear-48b-a3b-instruct")


def _blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(DOC.read_text())


def test_the_page_covers_each_model_at_8_and_16_gpus():
    runs = {(Path(args[1]).name, args[args.index("--gpus") + 1]) for args in
            (shlex.split(cmd) for cmd, _ in _blocks())}  # fmt: skip
    assert {(m, g) for m in MODELS for g in ("8", "16")} <= runs


@pytest.mark.parametrize("cmd", [cmd for cmd, _ in _blocks()])
def test_each_block_is_the_commands_output(cmd, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the page's paths are the repository's
    want = dict(_blocks())[cmd]
    assert main(shlex.split(cmd)) == 0
    got = capsys.readouterr().out
    assert got.strip() == want.strip(), f"docs/plan.md is stale for `batchgen {cmd}`"


def _gib_a_gpu(cmd: str, precision: str) -> float:
    rows = [line.split("|") for line in dict(_blocks())[cmd].splitlines() if line.startswith("|")]
    return next(float(r[2]) for r in rows if r[1].strip().rstrip(" *") == precision)


@pytest.mark.parametrize(
    "model, precision, low, high",
    [  # GB on 8 GPUs: what the checkpoint holds, plus what every GPU holds whole
        ("deepseek-v3", "fp8", 671, 720),  # ~671 GB as it ships
        ("deepseek-v3", "bf16", 1340, 1400),  # ~1.34 TB
        ("kimi-k2-thinking", "int4-g32", 594, 650),  # ~594 GB as it ships
        ("kimi-k2-instruct", "fp8", 1026, 1080),  # ~1.03 TB
        ("kimi-linear-48b-a3b-instruct", "bf16", 98, 102),  # 49.1B parameters
    ],
)
def test_the_weights_add_up_to_what_the_models_ship(model, precision, low, high):
    cmd = f"plan tests/api/model_configs/{model} --gpus 8"
    total_gb = 8 * _gib_a_gpu(cmd, precision) * 2**30 / 1e9
    assert low <= total_gb <= high, total_gb
