"""The `batchgen` command.

    batchgen run INPUT -o OUTPUT [--model PATH|ORG/NAME] [--max-tokens N] [--temperature T] ...
    batchgen show OUTPUT
    batchgen plan MODEL --gpus N [--gpu h200] [--context T] ...
    batchgen eval mc|parity ...
    batchgen --version

Exit codes: run_command.py's docstring (and docs/batch-jobs.md); 2 is a usage error
for every subcommand.

--help, --version and `show` import neither torch nor transformers (seconds of imports):
`eval`'s options are built only when `eval` is the command (and its options import no
torch either: the eval package loads its other modules on first use), and a job's
modules are imported once its options are checked.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from batchgen.api.plan_command import add_plan_parser, run_plan
from batchgen.api.run_command import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, run_command
from batchgen.api.run_options import add_run_parser
from batchgen.api.show import add_show_parser, show
from batchgen.console import command_logging, usage_error

logger = logging.getLogger(__name__)

EVAL_HELP = "evaluate a model: multiple-choice accuracy, parity with transformers"


def build_parser(lazy_eval: bool = False) -> argparse.ArgumentParser:
    """The command line. With `lazy_eval`, `eval` is listed (EVAL_HELP) without its
    options, whose module would import torch: for a command that is not `eval`."""
    parser = argparse.ArgumentParser(
        prog="batchgen", description="Offline, high-throughput batch generation for LLMs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(sub)
    add_show_parser(sub)
    add_plan_parser(sub)
    if lazy_eval:
        sub.add_parser("eval", help=EVAL_HELP)
    else:
        from batchgen.eval.cli import add_eval_parser

        add_eval_parser(sub)
    return parser


def _version() -> str:
    """The installed package's version (from its metadata)."""
    try:
        return metadata.version("batchgen")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(lazy_eval=_command(argv) != "eval")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    quiet = getattr(args, "quiet", False)
    with command_logging(quiet, libraries=args.command != "show"):
        try:
            if args.command == "eval":
                from batchgen.eval.cli import run_eval

                return run_eval(args)
            if args.command == "plan":
                return run_plan(args)
            return _show(args) if args.command == "show" else run_command(args)
        except KeyboardInterrupt:  # before the job's own handlers are installed
            logger.warning("interrupted; rerun the same command to resume")
            return EXIT_INTERRUPTED


def _command(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word that is not an option (the top level
    has no option that takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _show(args: argparse.Namespace) -> int:
    if not args.output.is_file():
        usage_error(logger, "batchgen show", f"{args.output} does not exist or is not a file")
        return EXIT_USAGE
    show(args.output, sys.stdout)
    return EXIT_OK
