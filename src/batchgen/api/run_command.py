"""`batchgen run`: the job that runs under OUTPUT's lock once its options pass.

Exit codes (also in docs/batch-jobs.md):
    0  every line has its answer in OUTPUT
    1  some lines failed; each has an error record in OUTPUT's .errors.jsonl file
    2  usage error (bad option, missing input, unknown model); nothing was run
    3  interrupted (SIGINT/SIGTERM); rerun the same command to resume
    4  internal error; what was written is intact, rerun the same command to resume

Every option is checked before anything is read or loaded, each error naming the option
and the value given (run_options.py holds the options and their checks). Importing this
module imports neither torch nor transformers: the job's modules come once the options
pass.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from batchgen.api.batch_journal import InputMismatch
from batchgen.api.run_options import DEFAULT_MODEL_NAME, attention_data_parallel, check_run
from batchgen.console import usage_error

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED_LINES, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_INTERNAL = 0, 1, 2, 3, 4
# errors a job raises that are the user's to fix, not the job's: a usage error (exit 2)
USAGE_ERRORS: tuple[type[Exception], ...] = (InputMismatch,)


def _usage_error(message: str) -> int:
    usage_error(logger, "batchgen run", message)
    return EXIT_USAGE


def run_command(args: argparse.Namespace) -> int:
    """`batchgen run` with parsed arguments: its exit code."""
    from batchgen.api.batch_journal import OutputLock, OutputLocked

    problem = check_run(args)
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
        deterministic=args.deterministic,
        max_model_len=args.max_model_len,
        kv_cache_size_gib=args.kv_cache_gib,
        host_kv_size_gib=args.host_kv_gib,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.enable_expert_parallel,
        seed=args.seed,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.distributed_executor_backend != "mp":
        kwargs["distributed_executor_backend"] = args.distributed_executor_backend
    if attention_data_parallel(args):  # one engine of N ranks
        kwargs["data_parallel_size"] = args.data_parallel
    elif args.data_parallel is not None:
        return _run_data_parallel(args, opts, kwargs)

    from batchgen.api.llm import LLM
    from batchgen.config import EngineConfig

    try:
        device = EngineConfig(device=args.device).torch_device()
    except ValueError as e:
        return _usage_error(f"--device {args.device}: {e}")
    ranks = f", {args.tp} tensor-parallel ranks" if args.tp > 1 else ""
    if attention_data_parallel(args):
        ranks = f", {args.data_parallel} data-parallel ranks"
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
