"""W8 `dp-ep`: attention data parallel + expert parallel against tensor parallel and
against independent one-GPU engines, on W4's and W6's models over N GPUs.

    PYTHONPATH=src python3 -m benchmarks.dp_ep --gpus 8 --model moonlight-w4 --out $OUT  # 8 GPUs
    PYTHONPATH=src python3 -m benchmarks.dp_ep --gpus 8 --model kimi-w6 --out $OUT
    PYTHONPATH=src python3 -m benchmarks.dp_ep --gpus 4 --model moonlight-w4 --out $OUT  # 4 GPUs
    PYTHONPATH=src python3 -m benchmarks.dp_ep --gpus 4 --model kimi-w6 --out $OUT
    PYTHONPATH=src python3 -m benchmarks.dp_ep --gpus 2 --model moonlight-w4 --out $OUT  # 2 GPUs
    PYTHONPATH=src python3 -m benchmarks.dp_ep --gpus 2 --model kimi-w6 --out $OUT
    PYTHONPATH=src python3 -m benchmarks.dp_ep --small --model moonlight-w4 --out /tmp/w8  # CPU
    PYTHONPATH=src python3 -m benchmarks.dp_ep --small --gpus 4 --model kimi-w6 --out /tmp/w8

(from the repository root; `python3 -m benchmarks w8 ...` is the same, and --layouts
dp-ep,tp runs some of the three. The GPU runs need the `ray` extra for the engines
layout; --small runs 2 gloo ranks on the CPU unless --gpus says more.)

Model: --model's architecture with random weights drawn by the engine
(load_format="dummy"): moonlight-w4 is W4's (workloads.MOONLIGHT_W4, DeepSeek-V3: MLA +
MoE), kimi-w6 W6's (workloads.KIMI_W6, Kimi Linear: KDA + MLA + MoE). Workload: W4's
requests scaled to the GPUs, 512 x N prompts of 1,024 random tokens (4,096 on 8 GPUs),
128 output tokens each, greedy, ignore_eos, host tier on (--host-gib a rank or engine).
Three layouts, each in a process of its own (fresh GPUs, its own torch.distributed world):

    dp-ep    one engine, LLM(data_parallel_size=N, enable_expert_parallel=True): each rank
             its own requests' latent pages, state slots and host tier, the experts split
             over the ranks (all-to-all); timed after a warm-up, as W4's run is
    tp       one engine, LLM(tensor_parallel_size=N): every rank holds every request's
             latent pages; timed after the same warm-up
    engines  N one-GPU engines through Ray data parallel (api/data_parallel.py, as
             `batchgen run --data-parallel N`) over the requests as a batch file; timed
             from every engine loaded (data_parallel's clock), without a warm-up: the
             runs before it left the Triton kernels compiled on disk. Their KV pages
             come from a probe: one such engine built alone in a process of its own

Per layout: output tok/s, tok/s per GPU, KV pages per GPU (each rank's device pool;
engines: the probe's), the distinct pages the layout holds (dp-ep and engines: every
GPU's; tp: one GPU's, each rank holding the same requests), the most pages each rank
held at once (sampled every --sample-every steps; engines: not seen), the step messages
rank 0 sent per engine step (mean and max bytes, and each step's in the JSON's
"step_bytes"; engines: none), the timed part's counters, and whether every
request got its 128 tokens. Then the issue's goals: dp-ep's tok/s over tp's (>= 1.5) and
its tok/s per GPU over the engines' (>= 1, where the model fits one GPU; a layout that
fails is reported with its error and left out of the ratios). Writes dp_ep.json into
--out and prints a Markdown table.

--small: tiny DeepSeek-V3 (workloads.SMALL_MOONLIGHT) or Kimi Linear
(workloads.SMALL_KIMI_X8: its heads and experts divide by 8) configs on the CPU in
float32, gloo ranks, 12 x N requests of 24 tokens and 8 output tokens, a pool of 40
pages of 16 tokens a rank (tp's ranks cannot hold every request at once; each dp-ep rank
can), a 0.01 GiB host tier: seconds to a minute, for CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.dp_ep_runs import probe, run_engines, timed_engine
from benchmarks.engine_runs import add_engine_args, engine_kwargs, threads_for
from benchmarks.workloads import (
    KIMI_W6,
    MOONLIGHT_W4,
    SMALL_KIMI_X8,
    SMALL_MOONLIGHT,
    config_dir,
    w4_requests,
)

LAYOUTS = ("dp-ep", "tp", "engines")
# --model: (config, its CPU-sized version for --small)
MODELS = {"moonlight-w4": (MOONLIGHT_W4, SMALL_MOONLIGHT), "kimi-w6": (KIMI_W6, SMALL_KIMI_X8)}
REQUESTS_PER_GPU, SMALL_REQUESTS_PER_RANK = 512, 12
SMALL_PAGES = 40  # a rank's pool with --small: 12 x N requests of 2 pages overflow it on tp
RUN_TIMEOUT_S = 3600


def workload(args) -> tuple[list[list[int]], list[int]]:
    """W4's requests, 512 a GPU (--small: 12 a rank of 24 tokens, 8 output tokens)."""
    if args.small:
        n = SMALL_REQUESTS_PER_RANK * args.gpus
        return w4_requests(n=n, prompt_len=24, out_len=8, max_token=500)
    return w4_requests(n=REQUESTS_PER_GPU * args.gpus)


def model_dir(args) -> Path:
    """The folder of --model's config.json (--small: its CPU-sized version)."""
    full, small = MODELS[args.model]
    path = args.ckpt or Path(f"/tmp/batchgen-w8-{args.model}-config")
    if args.small:
        return config_dir(path.with_name(path.name + "-small"), small, "float32")
    return config_dir(path, full)


def base_kwargs(args, prompts, out_lens) -> dict:
    """The EngineConfig fields every layout shares (one rank's or one engine's)."""
    kw = dict(load_format="dummy", **engine_kwargs(args))
    kw["max_model_len"] = max(map(len, prompts)) + max(out_lens) + 16
    if args.small:
        kw.update(device="cpu", dtype="float32", num_kv_pages=SMALL_PAGES, host_kv_size_gib=0.01)
    else:
        kw.update(device="cuda", dtype="bfloat16", host_kv_size_gib=args.host_gib)
    return kw


def layout_kwargs(layout: str, gpus: int) -> dict:
    if layout == "dp-ep":
        return dict(data_parallel_size=gpus, enable_expert_parallel=True)
    if layout == "tp":
        return dict(tensor_parallel_size=gpus)
    return {}  # engines and the probe: one GPU each


def run_layout(args, layout: str) -> dict:
    """One layout's run in this process (a child of main's)."""
    prompts, out_lens = workload(args)
    kw = base_kwargs(args, prompts, out_lens)
    ckpt = model_dir(args)
    if layout == "engines":
        shard_size = 4 if args.small else 64
        return run_engines(ckpt, prompts, out_lens, kw, args.gpus, shard_size)
    with threads_for(kw["device"]):
        if layout == "probe":
            return probe(ckpt, kw)
        kw.update(layout_kwargs(layout, args.gpus))
        return timed_engine(ckpt, prompts, out_lens, kw, args.sample_every)


def run_in_process(argv: list[str], layout: str) -> dict:
    """run_layout in a fresh Python process (this module with --one); a failed run is
    {"error": ...}, so the other layouts still report."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.dp_ep", *argv, "--one", layout]
        done = subprocess.run([*cmd, "--result", str(path)], timeout=RUN_TIMEOUT_S)
        if done.returncode != 0 or not path.is_file():
            return {"error": f"the {layout} run failed (exit code {done.returncode})"}
        return json.loads(path.read_text())


def ratios(runs: dict) -> dict:
    """The issue's goals: dp-ep over tp (tok/s), dp-ep over the engines (tok/s a GPU)."""

    def rate(name, key):
        run = runs.get(name) or {}
        return run.get(key) if "error" not in run else None

    out = {}
    dp, tp = rate("dp-ep", "tok_s"), rate("tp", "tok_s")
    if dp and tp:
        out["dp_ep_over_tp"] = dp / tp
        out["dp_ep_over_tp_goal_met"] = dp / tp >= 1.5
    dp, engines = rate("dp-ep", "tok_s_per_gpu"), rate("engines", "tok_s_per_gpu")
    if dp and engines:
        out["dp_ep_over_engines_per_gpu"] = dp / engines
        out["dp_ep_over_engines_goal_met"] = dp / engines >= 1.0
    return out


def table(result: dict) -> str:
    """The layouts as a Markdown table, the ratios under it."""
    head = (
        "| layout | GPUs | output tok/s | tok/s per GPU | KV pages per GPU | KV capacity "
        "(pages) | peak pages held per GPU | bytes/step mean | bytes/step max | steps "
        "| answered |"
    )
    lines = [head, "|" + "---|" * head.count(" |")]
    for name, run in result["layouts"].items():
        if "error" in run:
            lines.append(f"| {name} | {result['gpus']} | {run['error']} |" + " |" * 8)
            continue
        peak = run["kv_pages_held_peak"]
        mean, most = run["bytes_per_step_mean"], run["bytes_per_step_max"]
        lines.append(
            f"| {name} | {run['gpus']} | {run['tok_s']:.1f} | {run['tok_s_per_gpu']:.1f} | "
            f"{'/'.join(map(str, run['kv_pages_per_gpu']))} | {run['kv_capacity_pages']} | "
            f"{'n/a' if peak is None else '/'.join(map(str, peak))} | "
            f"{'n/a' if mean is None else f'{mean:.0f}'} | "
            f"{'n/a' if most is None else most} | {run['steps'] or 'n/a'} | "
            f"{run['requests_answered']}/{result['requests']} |"
        )
    r = result["ratios"]
    if "dp_ep_over_tp" in r:
        lines.append(f"\ndp-ep / tp: {r['dp_ep_over_tp']:.2f}x output tok/s (goal >= 1.5)")
    if "dp_ep_over_engines_per_gpu" in r:
        lines.append(
            f"dp-ep / engines: {r['dp_ep_over_engines_per_gpu']:.2f}x tok/s per GPU (goal >= 1)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moonlight-w4", choices=sorted(MODELS))
    ap.add_argument("--gpus", type=int, default=None, help="N (default 8; --small: 2 ranks)")
    ap.add_argument("--small", action="store_true", help="tiny models on the CPU, gloo ranks")
    ap.add_argument("--host-gib", type=float, default=32.0, help="host tier a rank or engine")
    ap.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"which to run, of {', '.join(LAYOUTS)}"
    )
    ap.add_argument(
        "--sample-every", type=int, default=None, help="steps between page counts (16; --small 1)"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    add_engine_args(ap)
    ap.set_defaults(ckpt=None)
    args = ap.parse_args(argv)
    args.gpus = args.gpus or (2 if args.small else 8)
    args.sample_every = args.sample_every or (1 if args.small else 16)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if args.gpus < 2 or not layouts or set(layouts) - set(LAYOUTS):
        ap.error(f"--gpus must be 2 or more and --layouts of {LAYOUTS}; got {args.gpus}, {layouts}")
    if args.one is not None:  # a child process: one layout, its result to --result
        args.result.write_text(json.dumps(run_layout(args, args.one)))
        return 0
    if not args.small:
        import torch

        if torch.cuda.device_count() < args.gpus:
            ap.error(f"--gpus {args.gpus}: {torch.cuda.device_count()} GPUs visible")
    model_dir(args)  # made once here rather than by every child
    runs = {}
    for layout in layouts:
        started = time.perf_counter()
        runs[layout] = run_in_process(argv, layout)
        if layout == "engines" and "error" not in runs[layout]:
            probed = run_in_process(argv, "probe")
            runs[layout] = with_probe(runs[layout], probed, args.gpus)
        sys.stderr.write(f"{layout}: done in {time.perf_counter() - started:.1f} s\n")
    prompts, out_lens = workload(args)
    result = {
        "model": args.model,
        "small": args.small,
        "gpus": args.gpus,
        "requests": len(prompts),
        "prompt_len": len(prompts[0]),
        "output_len": out_lens[0],
        "layouts": runs,
        "ratios": ratios(runs),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dp_ep.json").write_text(json.dumps(result, indent=1))
    sys.stdout.write(table(result) + "\n")
    ok = all("error" not in run and run["all_outputs"] for run in runs.values())
    return 0 if ok else 1


def with_probe(run: dict, probed: dict, gpus: int) -> dict:
    """The engines' run with the probe's pool: KV pages a GPU, and N of them in all."""
    pages = probed.get("kv_pages")
    return dict(
        run,
        kv_pages_per_gpu=[pages] * gpus if pages is not None else [],
        kv_capacity_pages=pages * gpus if pages is not None else None,
        probe=probed,
    )


if __name__ == "__main__":
    sys.exit(main())
