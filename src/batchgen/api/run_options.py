"""`batchgen run`'s options (`add_run_parser`) and their checks (`check_run`), made
before anything is read or loaded; run_command.py runs the job once they pass.

Importing this module imports neither torch nor transformers: `--help` stays fast.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


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
        "--quantization",
        default=None,
        choices=["fp8"],
        help="quantize a float checkpoint's linear layers as they load: fp8 = block-scaled "
        "FP8 weights, 128x128 blocks (default: the checkpoint as stored; an FP8 "
        "checkpoint stays FP8 either way)",
    )
    run.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="KV pages' dtype: fp8 = float8_e4m3fn K/V (MLA: the latent), half a bf16 "
        "page's bytes, scale 1.0 (default: auto, the compute dtype)",
    )
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
        "-tp",
        dest="tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model's heads over N processes, one GPU each (NCCL; gloo ranks "
        "with --device cpu); with --data-parallel, every engine is such a group (default: 1)",
    )
    run.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tp N on a mixture-of-experts model: place the routed experts by "
        "rank and send tokens to their experts' ranks and back (all-to-all) instead of "
        "every rank computing its experts' share of every token; with --data-parallel N: "
        "attention data parallel, one engine of N ranks each running its own share of "
        "the requests (no Ray)",
    )
    run.add_argument(
        "--data-parallel",
        "--data-parallel-size",
        "-dp",
        dest="data_parallel",
        type=int,
        default=None,
        metavar="N",
        help="run N engines as Ray actors (one GPU each, or one CPU with --device cpu; "
        "--tp GPUs or CPUs each with --tp) over shards of the input; needs "
        "pip install 'batchgen[ray]'. With --enable-expert-parallel: one engine of N "
        "data-parallel ranks instead",
    )
    run.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default="mp",
        help="how one engine's ranks past the first start (--tp N, or --data-parallel N "
        "with --enable-expert-parallel): mp, processes of this host (default); ray, Ray "
        "actors placed over the hosts of a Ray cluster (RAY_ADDRESS, else a local one; "
        "needs pip install 'batchgen[ray]')",
    )
    run.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="N",
        help="input lines per shard under --data-parallel (default: 64; an error without it)",
    )
    run.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant arithmetic: each line's answer is the same bits however "
        "the job batches it (alone, with others, resumed, chunked); slower",
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


def check_run(args: argparse.Namespace) -> str | None:
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
    attention_dp = attention_data_parallel(args)
    if attention_dp and args.tp > 1:
        return (
            "--data-parallel with --enable-expert-parallel runs one process a rank: "
            f"--tp must be 1 for now, got {args.tp} (tensor parallel inside a rank would "
            "not split its MLA latent cache; for "
            f"{args.data_parallel * args.tp} ranks use --data-parallel "
            f"{args.data_parallel * args.tp} --enable-expert-parallel, or --tp "
            f"{args.data_parallel * args.tp} --enable-expert-parallel)"
        )
    if args.enable_expert_parallel and args.tp < 2 and not attention_dp:
        return (
            f"--enable-expert-parallel spreads experts over ranks: it needs --tp > 1, got {args.tp}"
        )
    if args.shard_size is not None and args.data_parallel is None:
        return "--shard-size applies to --data-parallel runs only"
    if args.shard_size is not None and attention_dp:
        return "--shard-size applies to Ray data parallel (without --enable-expert-parallel)"
    if args.distributed_executor_backend == "ray":
        from batchgen.api.data_parallel import RayNotInstalled, import_ray

        if args.data_parallel is not None and not attention_dp:
            return (
                "--distributed-executor-backend ray spreads one engine's ranks: with "
                "--data-parallel it needs --enable-expert-parallel (Ray data parallel's "
                "engines start their --tp ranks on their own host)"
            )
        try:
            import_ray()
        except RayNotInstalled as e:
            return f"--distributed-executor-backend ray: {e}"
    if args.data_parallel is not None and not attention_dp:
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


def attention_data_parallel(args: argparse.Namespace) -> bool:
    """--data-parallel N > 1 with --enable-expert-parallel: one engine of N attention
    data-parallel ranks (LLM's data_parallel_size), not N Ray engines."""
    return bool(args.enable_expert_parallel) and (args.data_parallel or 1) > 1


def _shown(value) -> str:
    """A number as typed: -1, not -1.0."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _local_or_hub(model: str) -> bool:
    """A local path, or a name LLM() looks up in the Hugging Face cache (org/name)."""
    from batchgen.models.hub import looks_like_repo_id

    return Path(model).expanduser().exists() or looks_like_repo_id(model)
