"""Sampled batch lines: a resumed job draws what an uninterrupted one would (seeds from
the run's seed, the custom_id and the sample index), and `n` / `best_of` give one
output line with n choices."""

from __future__ import annotations

import json
import signal

import torch
from test_batch_run import _answers, _chat, _cli, _kill_part_way, _read, _spawn, _write_jsonl

from batchgen.api.cli import main

N_ROWS = 120


def _sampled(n: int) -> list[dict]:
    return [
        _chat(f"t{i}", f"w{3 + i * 11 % 500} w{3 + i * 5 % 500}", max_tokens=32, temperature=0.8)
        for i in range(n)
    ]


def test_a_resumed_sampled_job_gives_the_uninterrupted_texts(tmp_path, tiny_llama):
    """kill -9 part-way, then rerun, no --seed: every line, the resumed ones included,
    has the text of an uninterrupted run with the same --max-num-seqs (before, a
    request's seed came from its arrival index, and 20 of 120 texts matched). The
    uninterrupted run is in this process (only the killed run and its rerun need
    processes of their own), on one thread as theirs (OMP_NUM_THREADS=1)."""
    inp = _write_jsonl(tmp_path / "in.jsonl", _sampled(N_ROWS))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    common = ("--max-num-seqs", "8")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_cli(tiny_llama, inp, ref, *common)) == 0
    finally:
        torch.set_num_threads(threads)
    expected = _answers(ref)

    proc = _spawn(_cli(tiny_llama, inp, out, *common))
    _kill_part_way(proc, out, signal.SIGKILL)
    proc.wait(timeout=60)
    first = _answers(out, torn_ok=True)
    assert 20 <= len(first) < N_ROWS
    proc = _spawn(_cli(tiny_llama, inp, out, *common))
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()[-2000:]
    assert _answers(out) == expected
    texts = {text for text, _, _ in expected.values()}
    assert len(texts) > N_ROWS // 2, "sampling should give different texts"


def _choices(path) -> dict[str, dict]:
    return {r["custom_id"]: r["response"]["body"] for r in _read(path)}


def test_n_and_best_of_give_one_line_with_n_choices(tmp_path, tiny_llama):
    rows = [
        _chat("one", "w7 w8", max_tokens=8, ignore_eos=True),
        _chat("three", "w7 w8", max_tokens=8, ignore_eos=True, n=3),
        {
            "custom_id": "best",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "w9 w10", "max_tokens": 6, "ignore_eos": True, "n": 2, "best_of": 4},
        },
        _chat("bad", "w7", best_of=2),  # best_of is /v1/completions' only
    ]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out)) == 1
    bodies = _choices(out)
    three = bodies["three"]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in three["choices"]]
    assert len(set(texts)) > 1, texts
    assert three["usage"]["completion_tokens"] == 3 * 8
    assert three["usage"]["prompt_tokens"] == bodies["one"]["usage"]["prompt_tokens"]
    assert three["usage"]["total_tokens"] == three["usage"]["prompt_tokens"] + 24

    best = bodies["best"]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])
    assert best["usage"]["completion_tokens"] == 4 * 6  # every sample drawn counts

    errors = _read(tmp_path / "out.errors.jsonl")
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert "unknown body field 'best_of'" in errors[0]["error"]["message"]

    # sample 0 of a line draws what the line would draw with n = 1
    single = _write_jsonl(
        tmp_path / "single.jsonl", [_chat("three", "w7 w8", max_tokens=8, ignore_eos=True)]
    )
    assert main(_cli(tiny_llama, single, tmp_path / "single_out.jsonl")) == 0
    alone = _choices(tmp_path / "single_out.jsonl")["three"]["choices"][0]
    assert alone["message"]["content"] == texts[0]
    assert json.dumps(alone["message"]) != json.dumps(three["choices"][1]["message"])
