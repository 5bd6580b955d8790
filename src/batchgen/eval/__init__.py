"""Evaluation: multiple-choice scoring and greedy parity against transformers.

Each name below is imported from its module on first use (PEP 562), so importing one
module of this package (`batchgen eval --help` reads only cli.py) imports no other, and
not torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.eval.cli import add_eval_parser, run_eval
    from batchgen.eval.engine_scorer import EngineScorer, GreedyRun, Position, Query
    from batchgen.eval.mc import (
        MCQuestion,
        MCSet,
        MCTask,
        QuestionResult,
        build_prompt,
        load_mc_file,
    )
    from batchgen.eval.mc_report import MCReport, evaluate_mc
    from batchgen.eval.parity import ParityReport, PromptParity, load_prompts, run_parity
    from batchgen.eval.reference import TransformersReference
    from batchgen.eval.scoring import Accuracy, by_subject, wilson_interval

_HOMES = {  # name -> the module of this package that defines it
    "Accuracy": "scoring",
    "EngineScorer": "engine_scorer",
    "GreedyRun": "engine_scorer",
    "MCQuestion": "mc",
    "MCReport": "mc_report",
    "MCSet": "mc",
    "MCTask": "mc",
    "ParityReport": "parity",
    "Position": "engine_scorer",
    "PromptParity": "parity",
    "Query": "engine_scorer",
    "QuestionResult": "mc",
    "TransformersReference": "reference",
    "add_eval_parser": "cli",
    "build_prompt": "mc",
    "by_subject": "scoring",
    "evaluate_mc": "mc_report",
    "load_mc_file": "mc",
    "load_prompts": "parity",
    "run_eval": "cli",
    "run_parity": "parity",
    "wilson_interval": "scoring",
}

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


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
