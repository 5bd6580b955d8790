"""`batchgen eval parity`: the command on a tiny model, the comparison and threshold logic
on fabricated runs, and the prompt file formats."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import save_tiny_model

from batchgen.eval import parity
from batchgen.eval.cli import add_eval_parser, run_eval
from batchgen.eval.engine_scorer import GreedyRun, Position
from batchgen.eval.parity import ParityReport, PromptParity, compare_prompt, load_prompts


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="batchgen")
    add_eval_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def tiny_args(tiny, prompts, *extra: str) -> argparse.Namespace:
    return parse(
        ["eval", "parity", str(prompts), "--model", str(tiny), "--device", "cpu"]
        + ["--dtype", "float32", "--kv-cache-gib", "0.05", "--quiet", *extra]
    )


def test_parity_passes_at_threshold_one_on_the_tiny_model(tiny, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        "w5 w6 w7 w8 w9",
        {"prompt": " ".join(f"w{i}" for i in range(20, 60))},  # longer than a page
        {"prompt_token_ids": [1, 300, 301, 302]},
        {"messages": [{"role": "user", "content": "w40 w41"}]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "parity.json"
    args = tiny_args(tiny, prompts, "--max-tokens", "12", "--threshold", "1.0", "-o", str(out))
    assert run_eval(args) == 0
    text = capsys.readouterr().out
    assert "greedy agreement: 4/4 prompts identical (100.0%)" in text and "PASS" in text
    details = json.loads(out.read_text())
    assert details["agreement"] == 1.0 and details["max_logprob_diff"] < 1e-4
    assert all(p["first_divergence"] is None for p in details["prompts"])
    assert all(len(p["ours"]) > 0 for p in details["prompts"])


def test_parity_exit_code_follows_the_threshold(tiny, tmp_path, monkeypatch, capsys):
    """Exit 1 below the threshold, on a fabricated report (one of two prompts diverges)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6\nw7 w8\n")
    fabricated = ParityReport(
        [PromptParity(0, [5, 6], [5, 6], None, 1e-6), PromptParity(1, [5, 6], [5, 7], 1, 0.2)]
    )
    monkeypatch.setattr(parity, "run_parity", lambda *a, **k: fabricated)
    assert run_eval(tiny_args(tiny, prompts, "--threshold", "1.0")) == 1
    assert "FAIL" in capsys.readouterr().out
    assert run_eval(tiny_args(tiny, prompts, "--threshold", "0.5")) == 0
    assert (
        run_eval(tiny_args(tiny, prompts, "--threshold", "0.5", "--max-logprob-diff", "0.1")) == 1
    )


def test_report_threshold_logic():
    same = PromptParity(0, [1, 2, 3], [1, 2, 3], None, 1e-6)
    late = PromptParity(1, [1, 2, 3, 4], [1, 2, 9, 9], 2, 3e-3)
    report = ParityReport([same, late, PromptParity(2, [4], [4], None, 0.0)])
    assert report.agreement == pytest.approx(2 / 3)
    assert report.max_logprob_diff == 3e-3
    assert report.divergences == [2]
    assert report.token_agreement == pytest.approx((3 + 2 + 1) / (3 + 4 + 1))
    assert report.passes(0.6) and not report.passes(0.7) and not report.passes(1.0)
    assert report.passes(0.6, max_logprob_diff=1e-2) and not report.passes(0.6, 1e-3)
    assert ParityReport().passes(1.0)
    summary = report.summary()
    assert "2/3 prompts identical" in summary and "prompt 1: token 2: batchgen 3 " in summary
    assert "batchgen 3 'w3'" in report.summary(lambda ids: f"w{ids[0]}")


def steps(*exact: dict[int, float]) -> list[Position]:
    return [Position({}, e) for e in exact]


def test_compare_prompt_finds_the_first_divergence_and_bounds_the_logprob_check():
    ours = GreedyRun([7, 8, 9, 4], [-0.1, -0.2, -0.3, -0.4], "length")
    ref = GreedyRun([7, 8, 5, 4], [-0.1, -0.2, -0.25, -0.4], "length")
    # the reference's logprob of batchgen's token at each step; after the divergence the
    # contexts differ, so the large difference at step 3 must not count
    ref_steps = steps({7: -0.1}, {8: -0.21}, {9: -0.35}, {4: -5.0})
    p = compare_prompt(0, ours, ref, ref_steps)
    assert p.first_divergence == 2
    assert p.max_logprob_diff == pytest.approx(0.05)
    assert p.ours_token_ref_logprob == -0.35 and p.ref_token_ref_logprob == -0.25


def test_compare_prompt_treats_a_shorter_run_as_a_divergence():
    ours = GreedyRun([7, 2], [-0.1, -0.2], "stop")
    ref = GreedyRun([7, 2, 8], [-0.1, -0.2, -0.3], "length")
    p = compare_prompt(0, ours, ref, steps({7: -0.1}, {2: -0.2}, {}))
    assert p.first_divergence == 2 and p.max_logprob_diff == pytest.approx(0.0)
    same = compare_prompt(1, ref, ref, steps({7: -0.1}, {2: -0.2}, {8: -0.3}))
    assert same.identical


def test_load_prompts_formats(tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    text = tmp_path / "p.txt"
    text.write_text("w5 w6\n\nw7\n")
    assert load_prompts(text, tok) == [[5, 6], [7]]
    assert load_prompts(text, tok, chat=True)[1] == [10, 7, 11, 12]
    batch = tmp_path / "batch.jsonl"
    line = {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "w7"}]}}
    batch.write_text(json.dumps(line) + "\n" + json.dumps({"body": {"prompt": "w8 w9"}}) + "\n")
    assert load_prompts(batch, tok) == [[10, 7, 11, 12], [8, 9]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w5"}\n{"text": "w5"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompts(bad, tok)


def test_parity_usage_errors(tiny, tmp_path):
    assert run_eval(tiny_args(tiny, tmp_path / "missing.txt")) == 2
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5\n")
    assert run_eval(tiny_args(tiny, prompts, "--threshold", "1.5")) == 2
    assert run_eval(tiny_args(tiny, prompts, "--max-tokens", "0")) == 2
