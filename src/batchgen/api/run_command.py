"""`batchgen run`: its options, their checks, and the job that runs under OUTPUT's lock.

Exit codes (also in docs/batch-jobs.md):
    0  every line has its answer in OUTPUT
    1  some lines failed; each has an error record in OUTPUT's .errors.jsonl file
    2  usage error (bad option, missing input, unknown model); nothing was run
    3  interrupted (SIGINT/SIGTERM); rerun the same command to resume
    4  internal error; what was written is intact, rerun the same command to resume

Every option is checked before anything is read or loaded, each error naming the option
and the value given. Importing this module imports neither torch nor transformers: the
job's modules come once the options pass.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import replace
from pathlib import Path

from batchgen.api.batch_journal import InputMismatch
from batchgen.console import usage_error

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED_LINES, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_INTERNAL = 0, 1, 2, 3, 4
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# errors a job raises that are the user's to fix, not the job's: a usage error (exit 2)
USAGE_ERRORS: tuple[type[Exception], ...] = (InputMismatch,)


def add_run_parser(sub) -> None:
    """Add `run` to an argparse subparsers object."""
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
    run.add_argument("input", type=Path, nargs="?", metavar="INPUT", help="input JSONL file")
    run.add_argument(
        "-i",
        "--input-file",
        type=Path,
        default=None,
        metavar="INPUT",
        help="the input file, as an option (vLLM's run-batch -i); instead of INPUT",
    )
    run.add_argument(
        "-o",
        "--output",
        "--output-file",
        type=Path,
        required=True,
        metavar="OUTPUT",
        help="output JSONL file (appended to; errors go to OUTPUT.errors.jsonl)",
    )
    run.add_argument(
        "--model",
        default=None,
        metavar="MODEL",
        help="HF model directory, .gguf file or Hugging Face id (org/name, from the local "
        f"Hugging Face cache) (default: the embedded {DEFAULT_MODEL_NAME})",
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
        default=0,
        help="the run's seed: a request without its own seed gets one derived from this, "
        "its custom_id and its sample index, so reruns and resumes reproduce it (default: 0)",
    )
    run.add_argument(
        "--grace-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="on a first SIGINT/SIGTERM no new request starts and running ones get S "
        "seconds to finish; then the job stops (exit 3, rerun to resume); a second signal "
        "stops it at once (default: 10)",
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


def _usage_error(message: str) -> int:
    usage_error(logger, "batchgen run", message)
    return EXIT_USAGE


def run_command(args: argparse.Namespace) -> int:
    """`batchgen run` with parsed arguments: its exit code."""
    from batchgen.api.batch_journal import OutputLock, OutputLocked

    problem = _check_run(args)
    if problem is not None:
        return _usage_error(problem)
    out = args.output
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


def _check_run(args: argparse.Namespace) -> str | None:
    """What is wrong with `batchgen run`'s arguments, naming the option and the value
    given (None: nothing). Checked before anything is read, so a job with nothing left to
    run refuses a bad option as one with work does. Sets args.input from -i INPUT."""
    from batchgen.api.batch_journal import OutputLock, errors_path

    if args.input is not None and args.input_file is not None:
        return f"give the input once: INPUT ({args.input}) or -i ({args.input_file}), not both"
    args.input = args.input if args.input is not None else args.input_file
    if args.input is None:
        return "the input file is missing: batchgen run INPUT -o OUTPUT (or -i INPUT)"
    if not args.input.is_file():
        return f"input file {args.input} does not exist or is not a file"
    out = args.output
    if out.is_dir():
        return f"output {out} is a directory"
    own = {
        "output file": out,
        "errors file": errors_path(out),
        "lock file": OutputLock(out).path,
    }
    for what, path in own.items():
        if path.exists() and path.resolve() == args.input.resolve():
            return f"the input {args.input} is the {what} of -o {out}; give the batch file"
    for name, value, low, strict in (
        ("--max-tokens", args.max_tokens, 1, False),
        ("--max-num-seqs", args.max_num_seqs, 1, False),
        ("--max-model-len", args.max_model_len, 2, False),
        ("--kv-cache-gib", args.kv_cache_gib, 0, True),
        ("--host-kv-gib", args.host_kv_gib, 0, False),
        ("--tp", args.tp, 1, False),
        ("--data-parallel", args.data_parallel, 1, False),
        ("--shard-size", args.shard_size, 1, False),
        ("--temperature", args.temperature, 0, False),
        ("--grace-seconds", args.grace_seconds, 0, False),
    ):
        if value is not None and not (value > low if strict else value >= low):  # NaN too
            return f"{name} must be {'>' if strict else '>='} {low}, got {_shown(value)}"
    if not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {_shown(args.top_p)}"
    if not DEVICE.fullmatch(args.device):
        return f"--device must be auto, cpu, cuda or cuda:N, got {args.device}"
    if args.shard_size is not None and args.data_parallel is None:
        return "--shard-size applies to --data-parallel runs only"
    if args.data_parallel is not None:
        from batchgen.api.data_parallel import RayNotInstalled, import_ray

        if args.device not in ("auto", "cpu", "cuda"):
            return (
                "--data-parallel gives each engine its own GPU: --device must be auto, "
                f"cpu or cuda, got {args.device}"
            )
        try:
            import_ray()
        except RayNotInstalled as e:
            return f"--data-parallel: {e}"
    if args.model is not None and not _local_or_hub(args.model):
        return (
            f"--model {args.model} not found: no such file or directory, nor a Hugging "
            "Face id (org/name)"
        )
    return None


def _shown(value) -> str:
    """A number as typed: -1, not -1.0."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _local_or_hub(model: str) -> bool:
    """A local path, or a name LLM() looks up in the Hugging Face cache (org/name)."""
    from batchgen.models.hub import looks_like_repo_id

    return Path(model).expanduser().exists() or looks_like_repo_id(model)


def _model_name(model: str | None) -> str:
    """The name output lines carry: a hub id as given, else the file or folder's name."""
    from batchgen.models.hub import looks_like_repo_id

    if model is None:
        return DEFAULT_MODEL_NAME
    if not Path(model).expanduser().exists() and looks_like_repo_id(model):
        return model
    return Path(model).name.removesuffix(".gguf")


def _run_job(args: argparse.Namespace, out: Path) -> int:
    from batchgen.api.batch_job import (
        JobOptions,
        answered_earlier,
        errors_path,
        run_batch_job,
    )
    from batchgen.config import LARGE_GPU_LIMITS

    name = _model_name(args.model)
    opts = JobOptions(
        input=args.input,
        output=out,
        model_name=name,
        defaults={
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
        },
        seed=args.seed,
        grace_s=args.grace_seconds,
        # lines read ahead: 4 steps' rows. --data-parallel keeps this (its engines are
        # built later, elsewhere); one engine's own rows replace it once it is built
        max_in_flight=4 * (args.max_num_seqs or LARGE_GPU_LIMITS[0]),
        progress=not args.quiet,
    )
    try:
        finished = answered_earlier(opts)
    except USAGE_ERRORS as e:
        return _usage_error(str(e))
    except Exception as e:
        return _job_error(e, out, f"the job stopped on an internal error while reading {out}")
    if finished is not None:
        note = getattr(finished, "note", "") or "every input line already has its answer"
        logger.info(
            "done: %s, nothing to run (the model was not loaded): %s",
            note,
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
        seed=args.seed,
    )
    if args.data_parallel is not None:
        return _run_data_parallel(args, opts, kwargs)

    from batchgen.api.llm import LLM
    from batchgen.config import EngineConfig

    try:
        device = EngineConfig(device=args.device).torch_device()
    except ValueError as e:
        return _usage_error(f"--device {args.device}: {e}")
    ranks = f", {args.tp} tensor-parallel ranks" if args.tp > 1 else ""
    logger.info(
        "loading %s on %s%s; results follow once it is loaded",
        name if args.model else f"the default model {name}",
        device,
        ranks,
    )
    try:
        llm = LLM(model=args.model, **kwargs)
    except Exception as e:  # an unknown or broken model is a usage error
        return _usage_error(f"could not load model {args.model or DEFAULT_MODEL_NAME}: {e}")
    opts = replace(opts, max_in_flight=llm.engine.config.read_ahead)
    try:
        summary = run_batch_job(llm, opts)
    except USAGE_ERRORS as e:
        return _usage_error(str(e))
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
    except USAGE_ERRORS as e:
        return _usage_error(str(e))
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
