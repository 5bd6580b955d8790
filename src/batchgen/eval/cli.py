"""`batchgen eval mc FILE` and `batchgen eval parity PROMPTS`.

Wired into the `batchgen` command by api/cli.py:

    add_eval_parser(subparsers)            # adds the `eval` subcommand
    if args.command == "eval": return run_eval(args)

Exit codes: 0 done (parity: passed), 1 parity below the threshold, 2 usage error (bad
option, missing file, bad question or prompt, model not loadable), 4 internal error.
Results go to stdout; progress and logs to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_BELOW_THRESHOLD, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 4


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add `eval` (with `mc` and `parity`) to an argparse subparsers object."""
    ev = subparsers.add_parser(
        "eval",
        help="evaluate a model: multiple-choice accuracy, parity with transformers",
        description="Evaluate a model with batchgen: multiple-choice scoring (mc) and greedy "
        "parity against transformers on the same weights (parity).",
    )
    sub = ev.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    mc = sub.add_parser(
        "mc",
        help="multiple-choice accuracy (MMLU shape), optionally against transformers",
        description='Score a JSONL file of {"question", "choices", "answer", "subject"?} '
        'lines (an optional first line {"fewshot": "..."} is a header shared by every '
        "question) by the next-token logprobs of the choice labels after 'Answer:'. "
        "Reports accuracy with a 95% Wilson interval, per subject.",
    )
    mc.add_argument("file", type=Path, metavar="FILE", help="questions, JSONL")
    mc.add_argument(
        "--fewshot", type=Path, metavar="FILE", help="header text file (replaces the file's own)"
    )
    mc.add_argument(
        "--full-choice",
        action="store_true",
        help="also score each choice's full text by its log-likelihood",
    )
    mc.add_argument(
        "--labels",
        default=None,
        metavar="L1,L2,...",
        help="choice labels, comma-separated (default: A,B,C,...)",
    )
    mc.add_argument("--limit", type=int, default=None, metavar="N", help="first N questions only")
    mc.add_argument(
        "--reference",
        choices=["transformers"],
        default=None,
        help="also run transformers on the same prompts (float32) and compare",
    )
    _common(mc)
    par = sub.add_parser(
        "parity",
        help="greedy agreement with transformers on the same prompts and weights",
        description="Decode every prompt greedily with batchgen and with transformers on the "
        "same weights; report the agreement rate, where the first divergence falls and the "
        "largest logprob difference. Exits 1 when the agreement is below --threshold.",
    )
    par.add_argument(
        "prompts",
        type=Path,
        metavar="PROMPTS",
        help='a .jsonl file (strings, {"prompt"|"prompt_token_ids"|"messages"}, or OpenAI '
        'batch lines with those in "body") or a text file with one prompt per line',
    )
    par.add_argument("--max-tokens", type=int, default=32, metavar="N", help="default: 32")
    par.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        metavar="RATE",
        help="least fraction of prompts with identical greedy tokens to pass (default: 1.0)",
    )
    par.add_argument(
        "--max-logprob-diff",
        type=float,
        default=None,
        metavar="X",
        help="also fail when the largest logprob difference exceeds X",
    )
    par.add_argument(
        "--chat", action="store_true", help="send string prompts through the chat template"
    )
    _common(par)
    return ev


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="HF directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="most sequences in one engine step (default: 1024 on a GPU of 70 GiB or more, "
        "else 256)",
    )
    p.add_argument("--max-model-len", type=int, default=None, metavar="N")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="KV cache size (default: from free GPU memory; 1 GiB on the CPU)",
    )
    p.add_argument("-o", "--output", type=Path, default=None, metavar="JSON", help="details")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars, no logs but errors (results still go to stdout)",
    )


def run_eval(args: argparse.Namespace) -> int:
    """Run a parsed `batchgen eval ...` command; returns the exit code."""
    from batchgen.eval.mc import LETTERS

    src = args.file if args.eval_command == "mc" else args.prompts
    if not src.is_file():
        return _usage(f"{src} does not exist or is not a file")
    if args.model is not None and not Path(args.model).expanduser().exists():
        return _usage(f"model {args.model} not found (an HF model directory or a .gguf file)")
    if args.eval_command == "mc":
        labels = tuple(s.strip() for s in args.labels.split(",")) if args.labels else LETTERS
        if not all(labels) or len(set(labels)) != len(labels):
            return _usage(f"--labels must be distinct non-empty labels, got {args.labels!r}")
        if args.fewshot is not None and not args.fewshot.is_file():
            return _usage(f"few-shot file {args.fewshot} does not exist")
        if args.limit is not None and args.limit < 1:
            return _usage("--limit must be >= 1")
        return _guarded(_run_mc, args, labels)
    if args.max_tokens < 1 or not 0 <= args.threshold <= 1:
        return _usage("--max-tokens must be >= 1 and --threshold in [0, 1]")
    return _guarded(_run_parity, args)


def _guarded(fn, *args) -> int:
    try:
        return fn(*args)
    except (ValueError, OSError) as e:
        return _usage(str(e))
    except Exception:
        logger.exception("internal error")
        return EXIT_INTERNAL


def _usage(message: str) -> int:
    logger.error("error: %s", message)
    return EXIT_USAGE


def _engine(args):
    from batchgen.config import EngineConfig
    from batchgen.engine.engine_core import EngineCore

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_size_gib=args.kv_cache_gib,
    )
    return EngineCore.from_config(config)


def _reference(args, engine, progress: bool):
    from batchgen.eval.reference import TransformersReference
    from batchgen.models.default_model import default_model_path

    model = args.model or default_model_path(engine.config.cache_dir)
    return TransformersReference.load(model, device=engine.device, progress=progress)


def _model_name(args) -> str:
    from batchgen.models.default_model import DEFAULT_GGUF

    return Path(args.model).name if args.model else DEFAULT_GGUF


def _run_mc(args, labels: tuple[str, ...]) -> int:
    from batchgen.eval.engine_scorer import EngineScorer
    from batchgen.eval.mc import MCTask, load_mc_file
    from batchgen.eval.mc_report import evaluate_mc

    mcset = load_mc_file(args.file, args.fewshot, labels)
    if args.limit:
        mcset.questions = mcset.questions[: args.limit]
    engine = _engine(args)
    task = MCTask.prepare(mcset, engine.tokenizer, labels)
    progress = not args.quiet
    reference = _reference(args, engine, progress) if args.reference else None
    report = evaluate_mc(EngineScorer(engine, progress=progress), task, reference, args.full_choice)
    head = (
        f"model: {_model_name(args)} ({engine.dtype}, {engine.device})\n"
        f"questions: {args.file} ({len(mcset.questions)}; "
        f"{'a few-shot header' if mcset.header else 'no header'})\n"
    )
    sys.stdout.write(head + report.summary())
    if args.output:
        args.output.write_text(json.dumps(report.as_dict(), indent=1) + "\n", encoding="utf-8")
    return EXIT_OK


def _run_parity(args) -> int:
    from batchgen.eval.engine_scorer import EngineScorer
    from batchgen.eval.parity import load_prompts, run_parity

    engine = _engine(args)
    prompts = load_prompts(args.prompts, engine.tokenizer, args.chat)
    progress = not args.quiet
    reference = _reference(args, engine, progress)
    report = run_parity(
        EngineScorer(engine, progress=progress), reference, prompts, args.max_tokens
    )
    sys.stdout.write(
        f"model: {_model_name(args)} ({engine.dtype}, {engine.device}); "
        f"{len(prompts)} prompts, up to {args.max_tokens} tokens each\n"
        + report.summary(engine.tokenizer.decode)
    )
    if args.output:
        report.write_json(args.output)
    if report.passes(args.threshold, args.max_logprob_diff):
        sys.stdout.write(f"PASS (threshold {args.threshold})\n")
        return EXIT_OK
    sys.stdout.write(f"FAIL: below the threshold {args.threshold}\n")
    return EXIT_BELOW_THRESHOLD
