"""Running a multiple-choice evaluation on batchgen (and a reference) and reporting it."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.eval.engine_scorer import EngineScorer, Position
from batchgen.eval.mc import (
    MCTask,
    QuestionResult,
    max_logprob_diff,
    score_choices,
    score_letters,
)
from batchgen.eval.reference import TransformersReference
from batchgen.eval.scoring import accuracy, agreement, subject_table


@dataclass
class MethodResult:
    """One scoring method (letters or full choice) on batchgen and, if run, the reference."""

    name: str
    ours: list[QuestionResult]
    ref: list[QuestionResult] | None = None
    max_logprob_diff: float | None = None

    def summary(self) -> str:
        runs = {"batchgen": self.ours}
        if self.ref is not None:
            runs["transformers"] = self.ref
        lines = [f"{self.name} (accuracy [95% Wilson interval]):\n", subject_table(runs)]
        lines.append(f"no answer: {_no_answer(self.ours)}\n")
        censored = sum(r.censored for r in self.ours)
        if censored:
            lines.append(f"choice tokens outside the top-k (scored as the k-th): {censored}\n")
        if self.ref is not None:
            agree = agreement(self.ours, self.ref)
            lines.append(
                f"agreement with transformers: {agree.correct}/{agree.total} questions "
                f"({100 * agree.rate:.1f}%) pick the same answer\n"
                f"largest |logprob difference|: {self.max_logprob_diff:.3e}\n"
            )
        return "".join(lines)

    def as_dict(self) -> dict:
        out = {"batchgen": accuracy(self.ours).as_dict()}
        if self.ref is not None:
            out["transformers"] = accuracy(self.ref).as_dict()
            out["agreement"] = agreement(self.ours, self.ref).as_dict()
            out["max_logprob_diff"] = self.max_logprob_diff
        out["questions"] = [
            {
                "index": r.index,
                "subject": r.subject,
                "answer": r.answer,
                "predicted": r.predicted,
                "scores": r.scores,
                **({"reference_predicted": self.ref[i].predicted} if self.ref else {}),
            }
            for i, r in enumerate(self.ours)
        ]
        return out


@dataclass
class MCReport:
    methods: list[MethodResult] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0

    def summary(self) -> str:
        text = "".join(m.summary() + "\n" for m in self.methods)
        return text + (
            f"prefix cache: {self.prefix_hit_tokens} of {self.prompt_tokens} prompt tokens reused\n"
        )

    def as_dict(self) -> dict:
        return {m.name: m.as_dict() for m in self.methods} | {
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


def evaluate_mc(
    scorer: EngineScorer,
    task: MCTask,
    reference: TransformersReference | None = None,
    full_choice: bool = False,
) -> MCReport:
    """Letter scoring (and full-choice scoring) on batchgen, and on the reference if given."""
    engine = scorer.engine
    hits0, prompt0 = engine.kv.prefix_hit_tokens, engine.stats.prompt_tokens
    report = MCReport()
    queries = task.letter_queries()
    ours = scorer.positions(queries, "batchgen letters")
    report.methods.append(_method("letters", task, ours, reference, queries, score_letters))
    if full_choice:
        queries = task.choice_queries(engine.tokenizer)
        ours = scorer.positions(queries, "batchgen choices")

        def score(t: MCTask, pos: list[list[Position]]) -> list[QuestionResult]:
            return score_choices(t, queries, pos)

        report.methods.append(_method("full choice", task, ours, reference, queries, score))
    report.prefix_hit_tokens = engine.kv.prefix_hit_tokens - hits0
    report.prompt_tokens = engine.stats.prompt_tokens - prompt0
    return report


def _method(name, task, ours, reference, queries, score) -> MethodResult:
    result = MethodResult(name, score(task, ours))
    if reference is not None:
        ref = reference.positions(queries, f"transformers {name}")
        result.ref = score(task, ref)
        result.max_logprob_diff = max_logprob_diff(ours, ref)
    return result


def _no_answer(results: list[QuestionResult]) -> int:
    return sum(1 for r in results if r.predicted is None)
