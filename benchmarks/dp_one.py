"""DP=1/EP=1 on one GPU: W4's and W6's models on a plain engine and on one built with the
attention data-parallel and expert-parallel options at one rank, in one process (issue
52: "DP=1/EP=1 paths add no cost to W4 and W6, within noise, same run").

    PYTHONPATH=src python3 -m benchmarks.dp_one --out $OUT          # both models, H100/H200
    PYTHONPATH=src python3 -m benchmarks.dp_one --models kimi-w6 --repeats 3 --out $OUT
    PYTHONPATH=src python3 -m benchmarks.dp_one --small --out /tmp/dp1   # CPU, seconds

Per model (--models, in order: moonlight-w4 is W4's model, kimi-w6 W6's) two engines, one
after the other, each freed before the next is built (engine_runs.built_engine):

    plain    LLM(...) as W4 and W6 build it (moe_runs.workload_kwargs: random bf16
             weights, host tier on, the engine's defaults)
    dp1-ep1  the same with data_parallel_size=1, tensor_parallel_size=1,
             enable_expert_parallel=False named

enable_expert_parallel=True is refused at one rank (ParallelConfig: it spreads experts
over ranks and needs tensor_parallel_size or data_parallel_size > 1; the result's
"ep_at_one_rank" holds the error), so EP=1 is expert parallel off. At data_parallel_size 1
LLM builds no DPEngine (dp_attention.wants_dp_attention), the executor is OneRank with no
pairing, and builder_plan.expert_parallel gives the MoE layers no ExpertParallel: what
the DP/EP work left on this path is a check a forward (runner.pairing) and one a MoE
layer's eager forward (its `ep`; a decode graph's replay runs no Python of the layer).
Each engine's "built" says what it holds: the engine's and executor's classes, whether
its runner pairs forwards, its MoE layers by class and how many are expert parallel,
and the metrics keys that only DP/EP engines report (step_message*, dp_*); "same_build"
whether the two are alike. "kv_pages" is each engine's device pool: an engine not freed
before the next is built would shrink the next one's (the engine is dropped inside
built_engine's block so its exit collects it and empties the allocator's cache).

Workload: W4's requests (workloads.w4_requests: 512 prompts of 1,024 random tokens, 128
output tokens each, --requests fewer), greedy, ignore_eos. Each engine is warmed up as
W4's run is (moe_runs.warm_up), then timed --repeats times (2) over the requests
(throughput.timed_pass), each pass's prompts with a first token of their own so no pass
hits the pages an earlier one left. The full set is kept, so each pass's tok/s is W4's
or W6's own figure: a pass takes ~8 s on an H100 (65,536 output tokens; W4 ~7,800 tok/s,
W6 ~9,500 in HISTORY.md), the four passes of a model ~30 s, less than its two builds and
warm-ups (W4: build ~20 s and warm-up ~10 s on an H100; W6's first build ~48 s on an
empty Triton cache, ~25 s after; a 32 GiB host tier pinned in each): both models in
about 4-5 minutes (an estimate from those figures; --requests 256 halves the passes).
plain runs first for each model, so whatever a later engine gains or loses from running
second falls on dp1-ep1.

Reports per engine each pass's output tok/s, their mean and spread ((max - min) / mean:
the noise), per model the ratio dp1-ep1 / plain of the means, and whether it lies within
the noise (|ratio - 1| <= the larger spread; with 2 repeats a rough bound, and one that
leaves out what differs between two builds of one engine: the ratio itself measures
that, the two builds being alike). Writes dp_one.json into --out and prints a Markdown
table.

--small: the CPU-sized models (workloads.SMALL_MOONLIGHT, SMALL_KIMI) in float32, six
requests of 24 (W4) or 70 (W6) tokens and 6 output tokens (moe_runs.w4_workload), a
0.01 GiB host tier: seconds, for CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from benchmarks.engine_runs import add_engine_args, built_engine, comma_list
from benchmarks.moe_runs import w4_workload, warm_up, workload_kwargs
from benchmarks.throughput import timed_pass
from benchmarks.workloads import MODELS

# --models: (moe_runs.w4_workload's name for the config folder, --small's prompt length)
RUNS = {"moonlight-w4": ("w4", 24), "kimi-w6": ("w6", 70)}
FLAVOURS = {
    "plain": {},
    "dp1-ep1": dict(data_parallel_size=1, tensor_parallel_size=1, enable_expert_parallel=False),
}
# metrics() keys only attention DP or a step-message executor reports
DP_KEYS = ("step_message", "dp_")


def ep_at_one_rank() -> str:
    """What EngineConfig says to enable_expert_parallel=True at one rank ("" if taken)."""
    from batchgen.config import EngineConfig

    try:
        EngineConfig(data_parallel_size=1, enable_expert_parallel=True)
    except ValueError as e:
        return str(e)
    return ""


def built(llm) -> dict:
    """What the engine holds of attention DP and expert parallel."""
    from batchgen.layers.moe import DeepseekV3MoE

    eng = llm.engine
    moe = [m for m in eng.model.modules() if isinstance(m, DeepseekV3MoE)]
    return {
        "engine": type(eng).__name__,
        "executor": type(eng.executor).__name__,
        "pairing": eng.runner.pairing is not None,
        "moe_layers": dict(Counter(type(m).__name__ for m in moe)),
        "expert_parallel_layers": sum(m.ep is not None for m in moe),
        "dp_metrics_keys": sorted(k for k in eng.metrics() if k.startswith(DP_KEYS)),
        "parallel": {
            k: getattr(eng.config, k)
            for k in ("data_parallel_size", "tensor_parallel_size", "enable_expert_parallel")
        },
    }


def run_flavour(ckpt: Path, prompts, out_lens, args, flavour: str) -> dict:
    """One engine: built with FLAVOURS[flavour], warmed up, timed args.repeats times, freed."""
    kw = dict(workload_kwargs(prompts, out_lens, args), **FLAVOURS[flavour])
    with built_engine(ckpt, **kw) as llm:
        what, pages = built(llm), llm.engine.metrics()["kv_pages"]
        warm_up(llm, prompts)
        runs = [
            timed_pass(llm, prompts, out_lens, "greedy", k + 1, args.device)
            for k in range(args.repeats)
        ]
        del llm  # built_engine's exit frees the engine and the device memory it cached
    rates = [run["tok_s"] for run in runs]
    mean = sum(rates) / len(rates)
    return {
        "built": what,
        "kv_pages": pages,  # the device pool: the engine before would shrink it if not freed
        "runs": runs,
        "mean_tok_s": mean,
        "spread": (max(rates) - min(rates)) / mean,
        "all_outputs": all(run["output_tokens"] == sum(out_lens) for run in runs),
    }


def run_model(args, model: str) -> dict:
    name, small_len = RUNS[model]
    full, small = MODELS[model]
    one = argparse.Namespace(**vars(args))
    one.ckpt = args.ckpt / model if args.ckpt else None
    prompts, out_lens, ckpt = w4_workload(one, full, small, name, small_len)
    if args.requests:
        prompts, out_lens = prompts[: args.requests], out_lens[: args.requests]
    flavours = {}
    for flavour in FLAVOURS:
        flavours[flavour] = run_flavour(ckpt, prompts, out_lens, one, flavour)
        sys.stderr.write(f"{model} {flavour}: {flavours[flavour]['mean_tok_s']:.1f} tok/s\n")
    plain, dp1 = flavours["plain"], flavours["dp1-ep1"]
    ratio = dp1["mean_tok_s"] / plain["mean_tok_s"]
    noise = max(plain["spread"], dp1["spread"])
    return {
        "requests": len(prompts),
        "prompt_len": len(prompts[0]),
        "output_tokens_asked": sum(out_lens),
        "flavours": flavours,
        "ratio": ratio,
        "noise": noise,
        "within_noise": abs(ratio - 1) <= noise,
        "same_build": plain["built"] == dp1["built"],
    }


def describe(what: dict) -> str:
    moe = ", ".join(f"{n} {c}" for c, n in what["moe_layers"].items()) or "no MoE layer"
    return (
        f"{what['engine']}, {what['executor']}, pairing {what['pairing']}, {moe} "
        f"({what['expert_parallel_layers']} EP), DP metrics {what['dp_metrics_keys'] or 'none'}"
    )


def table(result: dict) -> str:
    lines = [
        "| model | engine | output tok/s a pass | mean | spread | KV pages | built |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, run in result["models"].items():
        for flavour, f in run["flavours"].items():
            passes = " / ".join(f"{r['tok_s']:.1f}" for r in f["runs"])
            lines.append(
                f"| {model} | {flavour} | {passes} | {f['mean_tok_s']:.1f} | "
                f"{100 * f['spread']:.2f}% | {f['kv_pages']} | {describe(f['built'])} |"
            )
    lines.append("")
    for model, run in result["models"].items():
        lines.append(
            f"{model}: dp1-ep1 / plain {run['ratio']:.4f}x, noise {100 * run['noise']:.2f}% "
            f"-> {'within' if run['within_noise'] else 'OUTSIDE'} noise; same build "
            f"{run['same_build']}"
        )
    lines.append(f"enable_expert_parallel=True at one rank: {result['ep_at_one_rank'] or 'taken'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default=",".join(RUNS),
        type=lambda text: comma_list(text, RUNS, f"--models takes names of {', '.join(RUNS)}"),
    )
    ap.add_argument("--repeats", type=int, default=2, help="timed passes an engine (2, >= 2)")
    ap.add_argument("--requests", type=int, default=0, help="the first N of W4's (0: all)")
    ap.add_argument("--small", action="store_true", help="tiny models on the CPU, float32")
    ap.add_argument("--host-gib", type=float, default=32.0, help="host tier (--small: 0.01)")
    add_engine_args(ap)
    ap.set_defaults(ckpt=None)
    args = ap.parse_args(argv)
    if args.repeats < 2 or args.requests < 0:  # the noise is the repeats' spread
        ap.error(f"--repeats >= 2 and --requests >= 0; got {args.repeats}, {args.requests}")
    result = {
        "small": args.small,
        "repeats": args.repeats,
        "ep_at_one_rank": ep_at_one_rank(),
        "models": {model: run_model(args, model) for model in args.models},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dp_one.json").write_text(json.dumps(result, indent=1))
    sys.stdout.write(table(result) + "\n")
    ok = all(
        f["all_outputs"] for run in result["models"].values() for f in run["flavours"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
