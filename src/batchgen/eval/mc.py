"""Multiple-choice scoring in the MMLU shape.

The file is JSONL, one question a line:

    {"question": "What is 2 + 3?", "choices": ["4", "5", "6", "7"], "answer": 1, "subject": "arithmetic"}

`answer` is the correct choice's 0-based index or its label ("B"); `subject` is
optional. An optional first line {"fewshot": "..."} holds a header shared by every
question (worked examples); `--fewshot FILE` replaces it. The prompt of a question:

    <header, if any>\\n\\n
    What is 2 + 3?\\n
    A. 4\\nB. 5\\nC. 6\\nD. 7\\n
    Answer:

Letter scoring reads the next-token distribution after "Answer:" and picks the label
token (" A", " B", ...) with the highest raw logprob. The engine reports the top-20
logprobs only: a label outside them counts as -inf, and a question with no label in the
top-20 has no answer (counted wrong). Full-choice scoring (`full_choice=True`) sums the
raw logprobs of each choice's text (" 5") after the same prompt, token by token; a token
outside the top-20 is censored: it counts as the 20th logprob there, an upper bound.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from pathlib import Path

from batchgen.eval.engine_scorer import Position, Query

LETTERS = tuple(string.ascii_uppercase)


@dataclass(frozen=True)
class MCQuestion:
    question: str
    choices: tuple[str, ...]
    answer: int
    subject: str | None = None


@dataclass
class MCSet:
    questions: list[MCQuestion]
    header: str = ""


def load_mc_file(
    path: str | Path, fewshot: str | Path | None = None, labels: tuple[str, ...] = LETTERS
) -> MCSet:
    """Read an MC JSONL file; raises ValueError naming the line of a malformed question."""
    header = ""
    questions: list[MCQuestion] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            if "fewshot" in obj:
                if questions or header:
                    raise ValueError(f"{path}:{lineno}: a fewshot line must come first")
                header = str(obj["fewshot"])
                continue
            questions.append(_question(obj, labels, f"{path}:{lineno}"))
    if fewshot is not None:
        header = Path(fewshot).read_text(encoding="utf-8")
    if not questions:
        raise ValueError(f"{path}: no questions")
    return MCSet(questions, header)


def _question(obj: dict, labels: tuple[str, ...], where: str) -> MCQuestion:
    text, choices, answer = obj.get("question"), obj.get("choices"), obj.get("answer")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) for c in choices)
    ):
        raise ValueError(f"{where}: 'choices' must be a list of 2 or more strings")
    if len(choices) > len(labels):
        raise ValueError(f"{where}: {len(choices)} choices but only {len(labels)} labels")
    if isinstance(answer, str) and answer.strip() in labels[: len(choices)]:
        answer = labels.index(answer.strip())
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise ValueError(
            f"{where}: 'answer' must be a choice index in [0, {len(choices)}) or one of "
            f"{', '.join(labels[: len(choices)])}, got {answer!r}"
        )
    subject = obj.get("subject")
    return MCQuestion(
        text.strip(), tuple(choices), answer, None if subject is None else str(subject)
    )


def build_prompt(question: MCQuestion, header: str = "", labels: tuple[str, ...] = LETTERS) -> str:
    """header, a blank line, the question, one "L. choice" line per choice, "Answer:"."""
    lines = [question.question]
    lines += [f"{label}. {choice}" for label, choice in zip(labels, question.choices)]
    body = "\n".join(lines) + "\nAnswer:"
    header = header.strip("\n")
    return f"{header}\n\n{body}" if header else body


def label_token_ids(tokenizer, prompt: str, labels: tuple[str, ...]) -> list[int]:
    """The token id each label gets right after `prompt`: " A" if that is one token
    extending the prompt's tokens, else "A"; ValueError if neither is, or two collide."""
    base = tokenizer.encode(prompt)
    ids = []
    for label in labels:
        for text in (" " + label, label):
            full = tokenizer.encode(prompt + text)
            if len(full) == len(base) + 1 and full[: len(base)] == base:
                ids.append(full[-1])
                break
        else:
            raise ValueError(f"label {label!r} is not a single token after the prompt")
    if len(set(ids)) != len(ids):
        raise ValueError(f"labels {labels} do not map to distinct tokens: {ids}")
    return ids


def continuation_ids(tokenizer, prompt: str, prompt_ids: list[int], text: str) -> list[int]:
    """The tokens `text` adds after the prompt (prompt+text tokenized jointly when that
    keeps the prompt's tokens as a prefix, else text on its own)."""
    full = tokenizer.encode(prompt + text)
    if full[: len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
        return full[len(prompt_ids) :]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"choice {text!r} has no tokens")
    return ids


@dataclass
class MCTask:
    """A set made ready for one tokenizer: prompts, their ids, the label tokens."""

    mcset: MCSet
    labels: tuple[str, ...]
    prompts: list[str]
    prompt_ids: list[list[int]]
    label_ids: list[int]

    @classmethod
    def prepare(cls, mcset: MCSet, tokenizer, labels: tuple[str, ...] = LETTERS) -> MCTask:
        prompts = [build_prompt(q, mcset.header, labels) for q in mcset.questions]
        width = max(len(q.choices) for q in mcset.questions)
        return cls(
            mcset,
            labels,
            prompts,
            [tokenizer.encode(p) for p in prompts],
            label_token_ids(tokenizer, prompts[0], labels[:width]),
        )

    def letter_queries(self) -> list[Query]:
        return [
            Query(ids, [], [self.label_ids[: len(q.choices)]])
            for ids, q in zip(self.prompt_ids, self.mcset.questions)
        ]

    def choice_queries(self, tokenizer) -> list[Query]:
        """One query per (question, choice), question-major."""
        queries = []
        for prompt, ids, q in zip(self.prompts, self.prompt_ids, self.mcset.questions):
            for choice in q.choices:
                cont = continuation_ids(tokenizer, prompt, ids, " " + choice)
                queries.append(Query(ids, cont, [[t] for t in cont]))
        return queries


@dataclass
class QuestionResult:
    """One question scored: a score per choice, the pick (None: no answer)."""

    index: int
    subject: str | None
    answer: int
    scores: list[float]
    predicted: int | None
    censored: int = 0  # full-choice: tokens outside the top-k, scored at the k-th logprob

    @property
    def correct(self) -> bool:
        return self.predicted == self.answer


def pick(scores: list[float]) -> int | None:
    """The highest finite score's index (the first on a tie), None if none is finite."""
    best = None
    for i, s in enumerate(scores):
        if s > -math.inf and (best is None or s > scores[best]):
            best = i
    return best


def letter_scores(position: Position, label_ids: list[int]) -> list[float]:
    return [position.top.get(t, -math.inf) for t in label_ids]


def choice_loglik(positions: list[Position], cont: list[int]) -> tuple[float, int]:
    """(sum of the cont tokens' logprobs, how many were censored at the top-k floor)."""
    total, censored = 0.0, 0
    for pos, token in zip(positions, cont):
        if token in pos.top:
            total += pos.top[token]
        else:
            total += min(pos.top.values())
            censored += 1
    return total, censored


def score_letters(task: MCTask, positions: list[list[Position]]) -> list[QuestionResult]:
    results = []
    for i, (q, pos) in enumerate(zip(task.mcset.questions, positions)):
        scores = letter_scores(pos[0], task.label_ids[: len(q.choices)])
        results.append(QuestionResult(i, q.subject, q.answer, scores, pick(scores)))
    return results


def score_choices(
    task: MCTask, queries: list[Query], positions: list[list[Position]]
) -> list[QuestionResult]:
    """Full-choice results from choice_queries() and their positions (question-major)."""
    results, k = [], 0
    for i, q in enumerate(task.mcset.questions):
        scores, censored = [], 0
        for _ in q.choices:
            total, c = choice_loglik(positions[k], queries[k].cont)
            scores.append(total)
            censored += c
            k += 1
        results.append(QuestionResult(i, q.subject, q.answer, scores, pick(scores), censored))
    return results


def max_logprob_diff(ours: list[list[Position]], ref: list[list[Position]]) -> float:
    """Largest |batchgen - transformers| raw logprob over the asked tokens batchgen reports."""
    worst = 0.0
    for our_q, ref_q in zip(ours, ref):
        for a, b in zip(our_q, ref_q):
            for token, lp in a.exact.items():
                if token in b.exact:
                    worst = max(worst, abs(lp - b.exact[token]))
    return worst
