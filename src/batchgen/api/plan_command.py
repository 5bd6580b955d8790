"""`batchgen plan MODEL --gpus N`: plan.py's fit as a table, one row a precision.

    batchgen plan deepseek-ai/DeepSeek-V3 --gpus 16 --gpu h200 --context 8192
    batchgen plan ./Kimi-Linear-48B-A3B-Instruct --gpus 8 --dp 8 --expert-parallel

MODEL is a directory holding config.json, the file itself, or a Hugging Face id whose
config.json is in the local cache (or can be fetched: nothing else is). Exit 2 on a
usage error (a layout that does not split the model included).
"""

from __future__ import annotations

import argparse
import logging
import sys

from batchgen.console import usage_error

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_USAGE = 0, 2


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="what fits: weight bytes per GPU by precision, KV pages left, largest batch",
        description=(
            "Reads only MODEL's config.json. Weights per GPU in bf16, fp8 (128x128 "
            "blocks) and int4 (groups of 32, 128; a MoE model's routed experts), the KV "
            "pages the engine's memory plan leaves beside them in bf16 and fp8 KV, and "
            "the largest batch of CONTEXT-token sequences those hold."
        ),
    )
    p.add_argument("model", help="a directory with config.json, the file, or a hub id")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: tp x dp)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default gpus/dp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="routed experts over all tp x dp GPUs; with --dp, attention data parallel",
    )
    p.add_argument("--gpu", default="h200", help="the card: h200, h100, a100, ... (default h200)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="another card's memory")
    p.add_argument("--context", type=int, default=8192, help="tokens a sequence holds")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=None,
        help="memory above the weights for activations (default: an estimate)",
    )
    p.add_argument("--revision", default=None, help="the hub id's branch, tag or commit")
    p.add_argument("--download-dir", default=None, help="the Hugging Face cache to read")
    return p


def run_plan(args: argparse.Namespace, out=None) -> int:
    """Print the plan's table to `out` (stdout); EXIT_USAGE on a bad option or layout."""
    from batchgen.api.plan import CARDS, Limits, plan
    from batchgen.api.plan_model import read_config

    out = out or sys.stdout
    command = "batchgen plan"
    try:
        parallel = _parallel(args)
        if args.gpu_memory_gib is None and args.gpu not in CARDS:
            raise ValueError(f"--gpu must be one of {', '.join(CARDS)} (or give --gpu-memory-gib)")
        config = read_config(args.model, args.revision, args.download_dir)
        given = {
            k: getattr(args, k)
            for k in ("gpu_memory_utilization", "page_size", "max_num_seqs", "max_num_batched_tokens")
            if getattr(args, k) is not None
        }  # fmt: skip
        card_bytes = int(args.gpu_memory_gib * 2**30) if args.gpu_memory_gib else None
        reserve = int(args.reserve_gib * 2**30) if args.reserve_gib is not None else None
        result = plan(
            config, parallel, args.gpu, args.context, Limits(**given), card_bytes, reserve
        )
    except (ValueError, FileNotFoundError) as e:
        usage_error(logger, command, str(e))
        return EXIT_USAGE
    out.write(format_plan(result) + "\n")
    return EXIT_OK


def _parallel(args: argparse.Namespace):
    from batchgen.api.plan_model import Parallel

    dp = args.dp
    tp = args.tp or (args.gpus // dp if args.gpus else 1)
    if args.gpus is not None and tp * dp != args.gpus:
        raise ValueError(f"--gpus {args.gpus} is not --tp {tp} x --dp {dp}")
    if args.context < 1:
        raise ValueError(f"--context must be at least 1, got {args.context}")
    return Parallel(tp, dp, args.expert_parallel)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def format_plan(p) -> str:
    """The plan as a header and a Markdown table (a row a precision; the one the
    checkpoint ships in marked *)."""
    name = p.config.name_or_path
    arch = (p.config.architectures or ["?"])[0]
    lines = [
        f"{name} ({arch}, {p.parameters / 1e9:,.1f}B parameters): {p.parallel.describe()} "
        f"on {p.parallel.gpus} x {p.card} ({_gib(p.card_bytes)} GiB, "
        f"{p.limits.gpu_memory_utilization:.0%} for the engine)",
        f"KV a token a GPU: {p.kv_bytes_per_token['bf16']:,} B in bf16, "
        f"{p.kv_bytes_per_token['fp8']:,} B in fp8; pages of {p.limits.page_size} tokens; "
        f"reserve {_gib(p.reserve_bytes)} GiB for activations; "
        f"max_num_seqs {p.limits.max_num_seqs}, max_num_batched_tokens "
        f"{p.limits.max_num_batched_tokens}",
    ]
    if p.state_slots:
        lines.append(
            f"state: {p.state_slots} slots a GPU ({_gib(p.state_bytes)} GiB), a row each: "
            "a batch holds at most that many rows an engine"
        )
    batch = f"batch @ {p.context:,} tokens"
    lines += [
        "",
        f"| weights | GiB / GPU | KV pages, bf16 KV | {batch} | KV pages, fp8 KV | {batch} |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for f in p.fits:
        mark = " *" if f.precision.shipped else ""
        if f.budget_bytes < 0:
            short = f"short by {_gib(-f.budget_bytes)} GiB"
            cells = [short, "0", short, "0"]
        else:
            cells = [f"{n:,}" for k in ("bf16", "fp8") for n in (f.kv_pages[k], f.batch[k])]
        lines.append(f"| {f.precision.name}{mark} | {_gib(f.weight_bytes)} | {' | '.join(cells)} |")
    if any(f.precision.shipped for f in p.fits):
        lines.append("\n\\* as the checkpoint ships (its quantization_config)")
    return "\n".join(lines)
