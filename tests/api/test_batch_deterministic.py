"""`batchgen run --deterministic`: a job killed with SIGKILL and resumed writes the lines
(texts, finish reasons, logprobs) of an uninterrupted run, which match a run that batches
its own way (another --max-num-seqs); without it, the two batchings differ."""

from __future__ import annotations

import random
import signal

import pytest
from test_batch_run import _cli, _kill_part_way, _read, _spawn, _write_jsonl
from twin_checkpoints import save_twin_model

from batchgen.api.cli import main

N_ROWS = 48


@pytest.fixture(scope="module")
def twin_model(tmp_path_factory):
    rng = random.Random(5)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(16)]
    return save_twin_model(tmp_path_factory.mktemp("twins"), prompts)


def _lines() -> list[dict]:
    """Chat lines of 1-30 words, greedy and sampled (seeded by the run), with logprobs."""
    rng = random.Random(9)
    rows = []
    for i in range(N_ROWS):
        words = " ".join(f"w{rng.randint(3, 500)}" for _ in range(rng.randint(1, 30)))
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 20}
        body.update({"temperature": 0.8} if i % 2 else {"temperature": 0})
        body["logprobs"] = True  # off-defaults: the lines' logprobs are compared too
        rows.append({"custom_id": f"d{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": body})  # fmt: skip
    return rows


def _choices(path) -> dict[str, dict]:
    return {r["custom_id"]: r["response"]["body"]["choices"] for r in _read(path)}


def _run(model, inp, out, *extra) -> dict[str, dict]:
    """`batchgen run` in this process (no interpreter, torch and Triton start-up per run:
    most of a tiny model's run); only the run the test kills needs a process of its own."""
    assert main(_cli(model, inp, out, *extra)) == 0
    return _choices(out)


@pytest.mark.slow
def test_a_resumed_deterministic_job_equals_any_batching(tmp_path, twin_model):
    inp = _write_jsonl(tmp_path / "in.jsonl", _lines())
    det = ("--deterministic",)
    ref = _run(twin_model, inp, tmp_path / "ref.jsonl", *det, "--max-num-seqs", "8")
    assert _run(twin_model, inp, tmp_path / "other.jsonl", *det, "--max-num-seqs", "3") == ref

    out = tmp_path / "out.jsonl"
    proc = _spawn(_cli(twin_model, inp, out, *det, "--max-num-seqs", "8"))
    _kill_part_way(proc, out, signal.SIGKILL)
    proc.wait(timeout=60)
    assert 20 <= len(_read(out, torn_ok=True)) < N_ROWS
    assert _run(twin_model, inp, out, *det, "--max-num-seqs", "8") == ref
    reasons = {c[0]["finish_reason"] for c in ref.values()}
    assert reasons == {"stop", "length"}  # EOS endings among them


@pytest.mark.slow
def test_without_deterministic_two_batchings_differ(tmp_path, twin_model):
    inp = _write_jsonl(tmp_path / "in.jsonl", _lines())
    eight = _run(twin_model, inp, tmp_path / "a.jsonl", "--max-num-seqs", "8")
    three = _run(twin_model, inp, tmp_path / "b.jsonl", "--max-num-seqs", "3")
    assert sum(eight[k] != three[k] for k in eight) > 0
