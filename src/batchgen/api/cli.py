"""The `batchgen` command.

    batchgen run INPUT -o OUTPUT [--model PATH] [--max-tokens N] [--temperature T] ...
    batchgen eval mc|parity ...
    batchgen --version

Exit codes (also in docs/batch-jobs.md):
    0  every line has its answer in OUTPUT
    1  some lines failed; each has an error record in OUTPUT's .errors.jsonl file
    2  usage error (bad option, missing input, unknown model); nothing was run
    3  interrupted (SIGINT/SIGTERM); rerun the same command to resume
    4  internal error; what was written is intact, rerun the same command to resume
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from dataclasses import replace
from importlib import metadata
from pathlib import Path

from batchgen.console import quiet_libraries
from batchgen.eval.cli import add_eval_parser, run_eval

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED_LINES, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_INTERNAL = 0, 1, 2, 3, 4
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgen", description="Offline, high-throughput batch generation for LLMs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run an OpenAI batch file (JSONL); resumable",
        description="Run every request of an OpenAI batch file (or the plain "
        '{"id", "prompt"|"messages"} form) and append OpenAI batch output lines to '
        "OUTPUT. Rerunning the same command resumes: lines already in OUTPUT are skipped. "
        "Bad lines get error records in OUTPUT's .errors.jsonl sibling. Options set in a "
        "request's body override the defaults below. Exit codes: 0 all done, 1 some lines "
        "failed, 2 usage error, 3 interrupted (rerun to resume), 4 internal error.",
    )
    run.add_argument("input", type=Path, metavar="INPUT", help="input JSONL file")
    run.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="OUTPUT",
        help="output JSONL file (appended to; errors go to OUTPUT.errors.jsonl)",
    )
    run.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help=f"HF model directory or .gguf file (default: the embedded {DEFAULT_MODEL_NAME})",
    )
    run.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    run.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="default max tokens per completion (default: up to the context)",
    )
    run.add_argument("--temperature", type=float, default=1.0, help="default: 1.0; 0 = greedy")
    run.add_argument("--top-p", type=float, default=1.0, help="default: 1.0")
    run.add_argument(
        "--seed",
        type=int,
        default=None,
        help="base seed: a request without its own seed gets one derived from "
        "this and its custom_id, so reruns reproduce it",
    )
    run.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="most sequences in one engine step (default: 1024 on a GPU of 70 GiB or more "
        "that is not an A100, 256 elsewhere and for models with linear-attention layers)",
    )
    run.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="context length: prompt + completion (default: the model's)",
    )
    run.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="fixed KV cache size (default: from free GPU memory; 1 GiB on the CPU)",
    )
    run.add_argument(
        "--host-kv-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="pinned host memory for the KV host tier: preempted requests are swapped "
        "there, not recomputed, and evicted prefixes come back from it (default: 0, off)",
    )
    run.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model's heads over N processes, one GPU each (NCCL; gloo ranks "
        "with --device cpu); with --data-parallel, every engine is such a group (default: 1)",
    )
    run.add_argument(
        "--data-parallel",
        type=int,
        default=None,
        metavar="N",
        help="run N engines as Ray actors (one GPU each, or one CPU with --device cpu; "
        "--tp GPUs or CPUs each with --tp) over shards of the input; needs "
        "pip install 'batchgen[ray]'",
    )
    run.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="N",
        help="input lines per shard under --data-parallel (default: 64; an error without it)",
    )
    run.add_argument(
        "--debug",
        action="store_true",
        help="engine self-checks (offload read-back, NaN/Inf checks)",
    )
    run.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing but errors (no progress bar, no logs, no summary)",
    )
    add_eval_parser(sub)
    return parser


def _version() -> str:
    """The installed package's version (from its metadata)."""
    try:
        return metadata.version("batchgen")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    restore = _setup_logging(args.quiet)
    try:
        return run_eval(args) if args.command == "eval" else _run(args)
    except KeyboardInterrupt:  # before the job's own handlers are installed
        logger.warning("interrupted; rerun the same command to resume")
        return EXIT_INTERRUPTED
    finally:
        restore()


def _usage_error(message: str) -> int:
    logger.error("error: %s", message)
    return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from batchgen.api.batch_journal import OutputLock, OutputLocked

    if not args.input.is_file():
        return _usage_error(f"input file {args.input} does not exist or is not a file")
    out = args.output
    if out.is_dir():
        return _usage_error(f"output {out} is a directory")
    if out.exists() and out.resolve() == args.input.resolve():
        return _usage_error("the output file must differ from the input file")
    for name, value, low in (
        ("--max-tokens", args.max_tokens, 1),
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--max-model-len", args.max_model_len, 2),
        ("--kv-cache-gib", args.kv_cache_gib, 1e-6),
        ("--host-kv-gib", args.host_kv_gib, 0),
        ("--tp", args.tp, 1),
        ("--data-parallel", args.data_parallel, 1),
        ("--shard-size", args.shard_size, 1),
    ):
        if value is not None and value < low:
            return _usage_error(f"{name} must be >= {low}, got {value}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        return _usage_error("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.shard_size is not None and args.data_parallel is None:
        return _usage_error("--shard-size applies to --data-parallel runs only")
    if args.data_parallel is not None:
        from batchgen.api.data_parallel import RayNotInstalled, import_ray

        if args.device not in ("auto", "cpu", "cuda"):
            return _usage_error(
                "--data-parallel gives each engine its own GPU: --device must be auto, "
                f"cpu or cuda, got {args.device}"
            )
        try:
            import_ray()
        except RayNotInstalled as e:
            return _usage_error(f"--data-parallel: {e}")
    if args.model is not None and not Path(args.model).expanduser().exists():
        return _usage_error(f"model {args.model} not found (an HF model directory or a .gguf file)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _usage_error(f"cannot create the output directory: {e}")
    lock = OutputLock(out)
    try:
        lock.acquire()
    except OutputLocked as e:
        return _usage_error(str(e))
    except OSError as e:
        return _usage_error(f"cannot create the lock file {lock.path}: {e}")
    try:  # held for the whole run: a second run on this output is refused
        return _run_job(args, out)
    finally:
        lock.release()


def _run_job(args: argparse.Namespace, out: Path) -> int:
    from batchgen.api.batch_job import (
        JobOptions,
        answered_earlier,
        errors_path,
        run_batch_job,
    )
    from batchgen.config import LARGE_GPU_LIMITS

    name = Path(args.model).name if args.model else DEFAULT_MODEL_NAME
    opts = JobOptions(
        input=args.input,
        output=out,
        model_name=name.removesuffix(".gguf"),
        defaults={
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
        },
        seed=args.seed,
        # lines read ahead: 4 steps' rows. --data-parallel keeps this (its engines are
        # built later, elsewhere); one engine's own rows replace it once it is built
        max_in_flight=4 * (args.max_num_seqs or LARGE_GPU_LIMITS[0]),
        progress=not args.quiet,
    )
    try:
        finished = answered_earlier(opts)
    except Exception as e:
        return _job_error(e, out, f"the job stopped on an internal error while reading {out}")
    if finished is not None:
        logger.info(
            "done: every input line already has its answer, nothing to run (the model "
            "was not loaded): %s",
            finished.describe(errors_path(out)),
        )
        return _exit_code(finished)

    kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        batchgen_debug=args.debug,
        max_model_len=args.max_model_len,
        kv_cache_size_gib=args.kv_cache_gib,
        host_kv_size_gib=args.host_kv_gib,
        tensor_parallel_size=args.tp,
    )
    if args.seed is not None:
        kwargs["seed"] = args.seed
    if args.data_parallel is not None:
        return _run_data_parallel(args, opts, kwargs)

    from batchgen.api.llm import LLM

    try:
        llm = LLM(model=args.model, **kwargs)
    except Exception as e:  # an unknown or broken model is a usage error
        return _usage_error(f"could not load model {args.model or DEFAULT_MODEL_NAME}: {e}")
    opts = replace(opts, max_in_flight=4 * llm.engine.config.max_num_seqs)
    try:
        summary = run_batch_job(llm, opts)
    except Exception as e:
        return _job_error(
            e,
            out,
            "the job stopped on an internal error; what was written is intact, "
            "rerun the same command to resume",
        )
    finally:
        llm.engine.shutdown()  # tensor parallel: its workers leave with the job
    return _job_done(summary, out)


def _run_data_parallel(args: argparse.Namespace, opts, kwargs: dict) -> int:
    from batchgen.api.data_parallel import (
        DataParallelError,
        DataParallelOptions,
        DataParallelUsageError,
        run_data_parallel,
    )

    out = opts.output
    try:
        shard = {} if args.shard_size is None else {"shard_size": args.shard_size}
        dp = DataParallelOptions(
            num_engines=args.data_parallel, model=args.model, engine_kwargs=kwargs, **shard
        )
        summary = run_data_parallel(opts, dp)
    except DataParallelUsageError as e:
        return _usage_error(f"--data-parallel: {e}")
    except DataParallelError as e:
        logger.error(
            "error: the job stopped: %s. What was written is intact: rerun the same "
            "command to resume",
            e,
        )
        return EXIT_INTERNAL
    except Exception as e:
        return _job_error(
            e,
            out,
            "the job stopped on an internal error; what was written is intact, "
            "rerun the same command to resume",
        )
    return _job_done(summary, out)


def _job_done(summary, out: Path) -> int:
    """Log how the job ended and return its exit code."""
    from batchgen.api.batch_journal import errors_path

    if summary.interrupted:
        logger.warning(
            "interrupted: %s. Rerun the same command to resume.", summary.describe(errors_path(out))
        )
        return EXIT_INTERRUPTED
    logger.info("done: %s", summary.describe(errors_path(out)))
    return _exit_code(summary)


def _job_error(error: Exception, out: Path, internal: str) -> int:
    """Log why the job stopped and return its exit code: a full disk is told plainly,
    with what is safely written and how to resume; anything else with its traceback."""
    import errno

    from batchgen.api.batch_journal import count_records, errors_path

    if not (isinstance(error, OSError) and error.errno == errno.ENOSPC):
        logger.exception(internal)
        return EXIT_INTERNAL
    errs = errors_path(out)
    logger.error(
        "error: the disk is full (%s); the job stopped. Safely written: %d results in %s "
        "and %d error records in %s, each line whole (a line cut short by the full disk "
        "is repaired on resume). Free some space, then rerun the same command to resume: "
        "it skips every line already answered and runs the rest.",
        error,
        count_records(out),
        out,
        count_records(errs),
        errs,
    )
    return EXIT_INTERNAL


def _exit_code(summary) -> int:
    return EXIT_FAILED_LINES if summary.failed or summary.failed_earlier else EXIT_OK


def _setup_logging(quiet: bool):
    """Log to stderr: batchgen's own records from INFO (the summary included), other
    libraries' from ERROR, and no Python warnings or progress bars beyond a terminal's
    (console.quiet_libraries); under --quiet errors only. Returns a function that puts
    back what this changed (main() may run in-process)."""
    logging.basicConfig(
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    loggers = [logging.getLogger(), logging.getLogger("batchgen")]
    old = [lg.level for lg in loggers]
    loggers[0].setLevel(logging.ERROR)
    loggers[1].setLevel(logging.ERROR if quiet else logging.INFO)
    scope = contextlib.ExitStack()
    scope.enter_context(quiet_libraries(quiet))

    def restore() -> None:
        scope.close()
        for lg, level in zip(loggers, old):
            lg.setLevel(level)

    return restore
