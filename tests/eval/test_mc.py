"""Multiple-choice scoring: file format, prompts, label tokens, interval math, per-subject
tables, the transformers reference path on a tiny model, and the shipped question set."""

from __future__ import annotations

import argparse
import calendar
import importlib.util
import json
import math
import random
import re
import string
from pathlib import Path

import pytest
from conftest import save_tiny_model

from batchgen.eval.cli import add_eval_parser, run_eval
from batchgen.eval.engine_scorer import Position
from batchgen.eval.mc import (
    MCQuestion,
    QuestionResult,
    build_prompt,
    choice_loglik,
    label_token_ids,
    load_mc_file,
    pick,
)
from batchgen.eval.scoring import Accuracy, by_subject, subject_table, wilson_interval

REPO = Path(__file__).resolve().parents[2]
LABELS = "w5,w6,w7,w8"  # the tiny word-level tokenizer has no "A": labels are its words


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="batchgen")
    add_eval_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- file format and prompts -------------------------------------------------------------


def test_load_mc_file_reads_header_letters_and_subjects(tmp_path):
    f = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"fewshot": "Q: 1+1?\nAnswer: B"},
            {"question": "2+2?", "choices": ["3", "4"], "answer": "B", "subject": "math"},
            {"question": " Sky? ", "choices": ["blue", "red", "green"], "answer": 0},
        ],
    )
    mcset = load_mc_file(f)
    assert mcset.header == "Q: 1+1?\nAnswer: B"
    assert mcset.questions == [
        MCQuestion("2+2?", ("3", "4"), 1, "math"),
        MCQuestion("Sky?", ("blue", "red", "green"), 0, None),
    ]
    header = tmp_path / "h.txt"
    header.write_text("other header\n")
    assert load_mc_file(f, fewshot=header).header == "other header\n"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "q", "choices": ["a", "b"], "answer": 2}, "'answer'"),
        ({"question": "q", "choices": ["a", "b"], "answer": "C"}, "'answer'"),
        ({"question": "q", "choices": ["a", "b"], "answer": True}, "'answer'"),
        ({"question": "q", "choices": ["a"], "answer": 0}, "'choices'"),
        ({"question": "", "choices": ["a", "b"], "answer": 0}, "'question'"),
    ],
)
def test_load_mc_file_names_the_bad_line(tmp_path, row, message):
    good = {"question": "q", "choices": ["a", "b"], "answer": 0}
    f = write_jsonl(tmp_path / "q.jsonl", [good, row])
    with pytest.raises(ValueError, match=rf"q.jsonl:2: {message}"):
        load_mc_file(f)


def test_build_prompt_with_and_without_header():
    q = MCQuestion("What is 2 + 3?", ("4", "5", "6", "7"), 1)
    body = "What is 2 + 3?\nA. 4\nB. 5\nC. 6\nD. 7\nAnswer:"
    assert build_prompt(q) == body
    assert build_prompt(q, "Example\nAnswer: A\n\n") == "Example\nAnswer: A\n\n" + body
    assert build_prompt(q, labels=("1", "2", "3", "4")).endswith("3. 6\n4. 7\nAnswer:")


class PieceTokenizer:
    """GPT-2-like pieces (" word", "word", punctuation), ids assigned on first sight;
    `split_space_letters` makes " A" two tokens (" ", "A") as some tokenizers do."""

    def __init__(self, split_space_letters: bool = False) -> None:
        self.vocab: dict[str, int] = {}
        self.split = split_space_letters

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = re.findall(r" ?\w+| ?[^\s\w]+|\s+", text)
        if self.split:
            pieces = [
                q for p in pieces for q in ([" ", p[1:]] if re.fullmatch(" [A-Z]", p) else [p])
            ]
        return [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]


def test_label_tokens_prefer_the_space_prefixed_letter():
    tok = PieceTokenizer()
    prompt = "Q?\nA. x\nB. y\nAnswer:"
    ids = label_token_ids(tok, prompt, ("A", "B"))
    assert ids == [tok.vocab[" A"], tok.vocab[" B"]]


def test_label_tokens_fall_back_to_the_bare_letter():
    tok = PieceTokenizer(split_space_letters=True)
    prompt = "Q?\nAnswer:"
    assert label_token_ids(tok, prompt, ("A", "B")) == [tok.vocab["A"], tok.vocab["B"]]


def test_label_tokens_must_be_distinct(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert label_token_ids(tok, "w20 Answer:", ("w5", "w6", "w7")) == [5, 6, 7]
    with pytest.raises(ValueError, match="distinct"):
        label_token_ids(tok, "w20 Answer:", ("A", "B"))  # both unknown words: <pad>


# ---- scoring rules ------------------------------------------------------------------------


def test_pick_takes_the_best_finite_score_and_the_first_on_a_tie():
    assert pick([-2.0, -1.0, -1.0, -3.0]) == 1
    assert pick([-math.inf, -5.0, -math.inf]) == 1
    assert pick([-math.inf, -math.inf]) is None


def test_choice_loglik_censors_tokens_outside_the_top_k():
    positions = [Position({7: -0.5, 8: -1.5}, {}), Position({9: -0.1, 10: -4.0}, {})]
    assert choice_loglik(positions, [8, 9]) == (-1.6, 0)
    assert choice_loglik(positions, [7, 3]) == (-0.5 - 4.0, 1)


@pytest.mark.parametrize(
    "correct, total, lo, hi",
    [
        (50, 100, 0.403832, 0.596168),
        (0, 10, 0.0, 0.277533),
        (10, 10, 0.722467, 1.0),
        (81, 263, 0.255289, 0.366210),
        (1, 1, 0.206549, 1.0),
    ],
)
def test_wilson_interval_known_values(correct, total, lo, hi):
    got = wilson_interval(correct, total)
    assert got == pytest.approx((lo, hi), abs=1e-6)


def test_wilson_interval_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_per_subject_aggregation():
    def r(subject, ok):
        return QuestionResult(0, subject, 0, [0.0], 0 if ok else None)

    results = [r("b", True), r("a", False), r("b", False), r("a", True), r(None, True)]
    table = by_subject(results)
    assert list(table) == ["(none)", "a", "b"]
    assert table["a"] == Accuracy(1, 2) and table["b"] == Accuracy(1, 2)
    assert table["(none)"] == Accuracy(1, 1)
    text = subject_table({"batchgen": results, "other": results[:4] + [r(None, False)]})
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == ["subject", "n", "batchgen", "other"]
    assert rows[-1][:3] == ["all", "5", "0.600"] and rows[-1][5] == "0.400"


# ---- the CLI on a tiny model against transformers ------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return path


def tiny_questions(path: Path, n: int = 12) -> Path:
    rng = random.Random(1)

    def words(k: int) -> str:
        return " ".join(f"w{rng.randint(20, 500)}" for _ in range(k))

    rows = [{"fewshot": words(40)}]  # a shared header: 2+ pages of prefix-cache hits
    rows += [
        {
            "question": words(rng.randint(2, 10)),
            "choices": [words(rng.randint(1, 3)) for _ in range(4)],
            "answer": rng.randrange(4),
            "subject": rng.choice(["s1", "s2", "s3"]),
        }
        for _ in range(n)
    ]
    return write_jsonl(path, rows)


def test_mc_reference_transformers_agrees_on_the_tiny_model(tiny, tmp_path, capsys):
    questions = tiny_questions(tmp_path / "q.jsonl")
    out = tmp_path / "details.json"
    args = parse(
        ["eval", "mc", str(questions), "--model", str(tiny), "--labels", LABELS]
        + ["--reference", "transformers", "--full-choice", "--device", "cpu", "--dtype", "float32"]
        + ["--kv-cache-gib", "0.05", "--quiet", "-o", str(out)]
    )
    assert run_eval(args) == 0
    text = capsys.readouterr().out
    assert text.count("agreement with transformers: 12/12 questions (100.0%)") == 2
    details = json.loads(out.read_text())
    for method in ("letters", "full choice"):
        assert details[method]["agreement"]["accuracy"] == 1.0
        assert details[method]["max_logprob_diff"] < 1e-4
        assert details[method]["batchgen"] == details[method]["transformers"]
        assert len(details[method]["questions"]) == 12
    assert details["prefix_hit_tokens"] > 0
    # the letter path sees real logprobs (some labels in the top-20), not only -inf
    assert any(math.isfinite(s) for q in details["letters"]["questions"] for s in q["scores"])


def test_mc_cli_usage_errors(tiny, tmp_path):
    assert run_eval(parse(["eval", "mc", str(tmp_path / "missing.jsonl")])) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "choices": ["a"], "answer": 0}])
    assert run_eval(parse(["eval", "mc", str(bad), "--model", str(tiny), "--quiet"])) == 2
    assert run_eval(parse(["eval", "mc", str(bad), "--labels", "A,A"])) == 2


# ---- the shipped question set --------------------------------------------------------------


def load_generator():
    spec = importlib.util.spec_from_file_location("make_mc_set", REPO / "scripts/make_mc_set.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHIPPED = REPO / "examples/mc/facts_arith.jsonl"
FEWSHOT = REPO / "examples/mc/fewshot.txt"


def test_shipped_set_is_the_generators_output():
    generated = load_generator().generate(seed=0)
    shipped = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    assert generated == shipped
    assert len(shipped) >= 320


def test_shipped_set_is_well_formed_and_loads_with_its_header():
    mcset = load_mc_file(SHIPPED, fewshot=FEWSHOT)
    assert len(mcset.questions) >= 320
    subjects = {q.subject for q in mcset.questions}
    assert {"arithmetic", "capitals", "chemistry", "calendar", "units"} <= subjects
    seen = set()
    for q in mcset.questions:
        assert len(q.choices) == 4 and len(set(q.choices)) == 4, q
        assert (q.question, q.choices[q.answer]) not in seen, q
        seen.add((q.question, q.choices[q.answer]))
    # the header's worked examples are not among the questions
    header_questions = {b.splitlines()[0] for b in mcset.header.split("\n\n")[1:]}
    assert len(header_questions) >= 3
    assert not header_questions & {q.question for q in mcset.questions}
    assert build_prompt(mcset.questions[0], mcset.header).count("Answer:") == 5


UNIT_FACTORS = {
    ("centimetres", "metres"): 100,
    ("metres", "kilometres"): 1000,
    ("grams", "kilograms"): 1000,
    ("millilitres", "litres"): 1000,
    ("minutes", "hours"): 60,
    ("seconds", "minutes"): 60,
    ("hours", "days"): 24,
    ("days", "weeks"): 7,
    ("months", "years"): 12,
    ("items", "dozens"): 12,
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [calendar.month_name[i] for i in range(1, 13)]
NUMBER_WORDS = {"two": 2, "three": 3, "four": 4}
MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def recompute(q: MCQuestion) -> str | None:
    """The correct choice, worked out independently of the generator (None: a fact)."""
    text, choices = q.question, q.choices
    if m := re.fullmatch(r"What is (\d+) ([-+x]) (\d+)\?", text):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str({"+": a + b, "-": a - b, "x": a * b}[op])
    if m := re.fullmatch(r"Which of these numbers is the (largest|smallest)\?", text):
        return str((max if m[1] == "largest" else min)(int(c) for c in choices))
    if m := re.fullmatch(r"Which of these numbers is (even|odd)\?", text):
        [hit] = [c for c in choices if (int(c) % 2 == 0) == (m[1] == "even")]
        return hit
    if m := re.fullmatch(r"How many (\w+) are in (\d+) (\w+)\?", text):
        return str(int(m[2]) * UNIT_FACTORS[(m[1], m[3])])
    if m := re.fullmatch(r"Which day of the week comes right after (\w+)\?", text):
        return DAYS[(DAYS.index(m[1]) + 1) % 7]
    if m := re.fullmatch(r"Which day of the week is (\w+) days after (\w+)\?", text):
        return DAYS[(DAYS.index(m[2]) + NUMBER_WORDS[m[1]]) % 7]
    if m := re.fullmatch(r"Which month comes right (before|after) (\w+)\?", text):
        return MONTHS[(MONTHS.index(m[2]) + (1 if m[1] == "after" else -1)) % 12]
    if m := re.fullmatch(r"How many days are in (\w+) in a year that is not a leap year\?", text):
        return str(MONTH_DAYS[MONTHS.index(m[1])])
    if m := re.fullmatch(
        r"Which letter comes right (before|after) ([A-Z]) in the English alphabet\?", text
    ):
        return chr(ord(m[2]) + (1 if m[1] == "after" else -1))
    if m := re.fullmatch(r"Which letter is number (\d+) in the English alphabet\?", text):
        return string.ascii_uppercase[int(m[1]) - 1]
    return None


def test_shipped_answers_are_correct():
    mcset = load_mc_file(SHIPPED)
    checked = 0
    for q in mcset.questions:
        expected = recompute(q)
        if expected is None:
            assert q.subject in ("capitals", "chemistry"), q
            continue
        assert q.choices[q.answer] == expected, q
        checked += 1
    assert checked >= 240
    spot = {
        "What is the capital of France?": "Paris",
        "What is the capital of Japan?": "Tokyo",
        "What is the capital of Australia?": "Canberra",
        "What is the chemical symbol for iron?": "Fe",
        "What is the chemical symbol for gold?": "Au",
        "What is the chemical symbol for potassium?": "K",
    }
    by_text = {q.question: q.choices[q.answer] for q in mcset.questions}
    assert {k: by_text[k] for k in spot} == spot
