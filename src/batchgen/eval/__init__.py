"""Evaluation: multiple-choice scoring and greedy parity against transformers."""

from batchgen.eval.cli import add_eval_parser, run_eval
from batchgen.eval.engine_scorer import EngineScorer, GreedyRun, Position, Query
from batchgen.eval.mc import MCQuestion, MCSet, MCTask, QuestionResult, build_prompt, load_mc_file
from batchgen.eval.mc_report import MCReport, evaluate_mc
from batchgen.eval.parity import ParityReport, PromptParity, load_prompts, run_parity
from batchgen.eval.reference import TransformersReference
from batchgen.eval.scoring import Accuracy, by_subject, wilson_interval

__all__ = [
    "Accuracy",
    "EngineScorer",
    "GreedyRun",
    "MCQuestion",
    "MCReport",
    "MCSet",
    "MCTask",
    "ParityReport",
    "Position",
    "PromptParity",
    "Query",
    "QuestionResult",
    "TransformersReference",
    "add_eval_parser",
    "build_prompt",
    "by_subject",
    "evaluate_mc",
    "load_mc_file",
    "load_prompts",
    "run_eval",
    "run_parity",
    "wilson_interval",
]
