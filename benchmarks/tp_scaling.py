"""W5 `tp2`: tensor-parallel scaling, TP=1 on one GPU against TP=N on N GPUs, in one run.

    python3 -m benchmarks.tp_scaling              # W5: Llama-3.1-8B's shape, W1's mix, TP=2
    python3 -m benchmarks.tp_scaling --tp 4       # TP=1 against TP=4
    python3 -m benchmarks.tp_scaling --small      # CPU (gloo ranks), seconds, for CI

The model is --model's architecture (default llama-3.1-8b) with random bf16 weights drawn
on the device (load_format="dummy"; under tensor parallel each rank draws its own share,
so the runs' tokens differ: tests/distributed/test_tp_gpu.py compares outputs). The
workload is W1's 256 requests, each run greedily to its W1 output length (ignore_eos),
after a short warm-up. Each size runs in a process of its own, so each starts from
fresh GPUs and its own torch.distributed world. Prints output tok/s of each size, the
speedup (tok/s at TP=N over tok/s at TP=1) and the scaling efficiency (speedup / N),
and writes tp_scaling.json into --out. Every engine default is on (decode CUDA graphs on
every rank, pipelined decode); --eager and the other engine options apply to both runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.engine_runs import (
    add_engine_args,
    add_model_args,
    dummy_model,
    engine_kwargs,
    timed_run,
)
from benchmarks.workloads import small_requests, w1_requests

RUN_TIMEOUT_S = 3600


def run_one(args: argparse.Namespace, size: int) -> dict:
    """One timed run at tensor_parallel_size=size, in this process."""
    _, ckpt = dummy_model(args)
    if args.small:
        prompts, out_lens = small_requests(16)
        kw = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_pages=64)
        warmup_len = 8
    else:
        prompts, out_lens = w1_requests()
        kw = dict(device="cuda", dtype="bfloat16", max_model_len=2048)
        warmup_len = 256
    result = timed_run(
        ckpt,
        prompts,
        out_lens,
        warmup_len,
        load_format="dummy",
        tensor_parallel_size=size,
        **kw,
        **engine_kwargs(args),
    )
    result.pop("timeline")  # per step; the totals are what this benchmark compares
    result["tensor_parallel_size"] = size
    return result


def run_in_process(argv: list[str], size: int) -> dict:
    """run_one at `size` in a fresh Python process (this module with --one)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        # the package from the working directory, as `python3 -m benchmarks.tp_scaling` ran
        cmd = [sys.executable, "-m", "benchmarks.tp_scaling", *argv, "--one", str(size)]
        cmd += ["--result", str(path)]
        done = subprocess.run(cmd, timeout=RUN_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"the TP={size} run failed (exit code {done.returncode})")
        return json.loads(path.read_text())


def scaling(one: dict, many: dict) -> dict:
    """Speedup and efficiency of `many` (a TP=N run) over `one` (TP=1)."""
    size = many["tensor_parallel_size"]
    speedup = many["tok_s"] / one["tok_s"]
    return {"tp": size, "speedup": speedup, "efficiency": speedup / size}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="the tensor-parallel size against TP=1")
    ap.add_argument("--small", action="store_true", help="tiny model and workload on the CPU")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    add_engine_args(ap)
    add_model_args(ap)
    ap.set_defaults(model="llama-3.1-8b")
    args = ap.parse_args(argv)
    if args.tp < 2:
        ap.error(f"--tp must be 2 or more (it is compared with TP=1), got {args.tp}")
    if args.one is not None:  # a child process: one size, its result to --result
        args.result.write_text(json.dumps(run_one(args, args.one)))
        return 0
    if not args.small:
        import torch

        if torch.cuda.device_count() < args.tp:
            ap.error(f"--tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} visible")
    dummy_model(args)  # the config directory, made once here rather than by both children
    runs = {str(size): run_in_process(argv, size) for size in (1, args.tp)}
    one, many = runs["1"], runs[str(args.tp)]
    result = {"model": args.model, "small": args.small, "runs": runs, **scaling(one, many)}
    for size, run in runs.items():
        print(
            f"TP={size}: {run['tok_s']:.1f} output tok/s ({run['output_tokens']} tokens in "
            f"{run['wall_s']:.2f} s; cuda_graphs={run['cuda_graphs']}, "
            f"all outputs: {run['all_outputs']})"
        )
    print(
        f"speedup TP={args.tp} / TP=1: {result['speedup']:.3f}, "
        f"efficiency {result['efficiency']:.3f}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_scaling.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
