"""W2 `pressure`: KV larger than the device pool, host tier on (swap) vs off (recompute).

On the GPU (from the repository root; device time includes building both engines):

    PYTHONPATH=src python3 -m benchmarks.pressure --out $OUT                       # W2, ~2 min
    PYTHONPATH=src python3 -m benchmarks.pressure --model llama-3.1-8b --out $OUT  # W2-8B, ~5 min
    PYTHONPATH=src python3 -m benchmarks.pressure --small --out /tmp/w2   # CPU, seconds, for CI

--model picks the architecture: qwen3-0.6b (W1's model, the default) or llama-3.1-8b
(W2-8B: 32 layers, hidden 4096, 8 KV heads, llama3 rope scaling, untied embeddings), both
with random bf16 weights drawn on the GPU (load_format="dummy": the model directory, --ckpt
or /tmp/batchgen-<model>-config, holds only config.json and a placeholder tokenizer).
1024 requests from workloads.w2_requests() (prompts 512-2048 tokens, outputs 128-512,
greedy, ignore_eos), device KV pool 8 GiB (--kv-gib). Two engines in one process, one
after the other (the first freed before the second is built): host tier on (64 GiB,
--host-gib: a preempted request is swapped to host and back) and off
(host_kv_size_gib=0: it is recomputed); --runs off,on reverses the order and --runs on
(or off) builds one engine alone (the first engine of a process pays for memory later
ones reuse, so the fairest comparison is one engine per process). --admission and
--tier-policy pass through to
both (default: the engine's defaults; under tier_policy="auto" the tier may judge a swap
dearer than a recompute and not swap; "always" swaps whatever it costs).

--profile [ROWS]: after each timed run, one decode step of ROWS (32) of the workload's
requests on that engine, as run and phase by phase (profiles.profile_decode: a
graph replay's GPU time, host phases, heaviest kernels, and the GPU's idle time per step
as run, put down to what the host was doing while it waited: profiles.gpu_idle), to tell
where a tier-on run's extra time per step goes: the timed runs' per-step timelines (pressure.json) show
whether it is in decode steps or in mixed ones: with both runs (one process, or --against
the other process's pressure.json) the summary splits the two runs' step times by kind,
step by step over their common schedule (step_split), and gives each run's CUDA
allocator counters (and its segments every 100 steps). --step-phases adds, by step kind,
the host milliseconds a step spent in the engine's main calls, tier on against off: a
step that waits on a copy shows where. --profile-emptied and
--profile-recaptured profile the step again after torch.cuda.empty_cache() and after the
decode graphs are captured again. --profile-only: the same profile on
each freshly built engine, with no timed run before it (pressure_profile.json).
--pin-gib G holds G GiB of host memory pinned the way the tier's pool is (registered with
CUDA) through every run, the tier-off one too: whether the pinned pool alone changes a
decode step.

Prints output tok/s of both, their ratio, preemptions / swaps / recomputes, tokens
computed, and the host<->device bandwidth of the tier's copies: bytes moved (write-through
stores, swap-outs and loads) over the summed copy-stream time, and of the swap traffic
alone (swap-outs and swap-ins, from the engine's per-reason counters), against the 55 GB/s
ceiling (BENCHMARKS.md; copies on the two copy streams may overlap, so the aggregate
rate can be above this figure). Writes pressure.json into --out; exits 1 when a run
lost output tokens, the tier-off run never recomputed (the workload did not press), or,
under tier_policy="always", the tier-on run never swapped.
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import Namespace
from functools import partial
from pathlib import Path

from benchmarks.card import HOST_COPY_GB_S
from benchmarks.engine_runs import (
    add_engine_args,
    add_model_args,
    add_policy_args,
    built_engine,
    checks_line,
    comma_list,
    cost_rule,
    dummy_model,
    engine_kwargs,
    policy_kwargs,
    size,
    timed_run,
)
from benchmarks.workloads import w2_requests


def small_workload() -> tuple[list[list[int]], list[int]]:
    """W2 scaled to the CPU: 24 requests, prompts 32-96 tokens, outputs 16-48; with a
    20-page (320-token) device pool about three fit, so decode growth preempts."""
    return w2_requests(n=24, prompt_lens=(32, 96), out_lens=(16, 48), max_token=500)


def parse_runs(text: str) -> list[str]:
    """The tier-on and tier-off engines to build, in the order given ("off,on")."""
    return comma_list(text, ("on", "off"), "--runs takes on, off, on,off or off,on")


def w2_engine_kwargs(args) -> dict:
    kw = engine_kwargs(args) | policy_kwargs(args) | dict(decode_append=args.decode_append)
    if args.small:
        return dict(kw, device="cpu", dtype="float32", max_model_len=96 + 48, num_kv_pages=20)
    return dict(
        kw, device="cuda", dtype="bfloat16", max_model_len=2048 + 512, kv_cache_size_gib=args.kv_gib
    )


def decode_profile(prompts: list[list[int]], args, llm) -> dict:
    """--profile: profiles.profile_decode on the run's engine at args.profile rows (the
    workload's first prompts, decoding past their prefill), so the tier-on and tier-off
    engines are compared on the same decode step: the step's wall time, its phases with
    a device sync around each, one graph replay's GPU time and the heaviest kernels."""
    from benchmarks.profiles import profile_decode

    ns = Namespace(max_num_seqs=args.profile, device=llm.engine.device.type)
    prof = profile_decode(llm, prompts, ns)
    if args.profile_emptied and torch_cuda():
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        prof["emptied"] = profile_decode(llm, prompts, ns)
    graphs = llm.engine.runner.graphs
    if args.profile_recaptured and graphs is not None:
        graphs.graphs.clear()  # captured again, lazily, by the profile's first decode step
        prof["recaptured"] = profile_decode(llm, prompts, ns)
    return prof


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pinned_ballast(gib: float):
    """--pin-gib: host memory registered with CUDA as the tier's pool is (or None)."""
    if gib <= 0:
        return None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--pin-gib needs a GPU")
    from batchgen.kv.pinned import host_empty

    return host_empty((int(gib * 2**30),), torch.uint8, pin=True)


def profile_only(args, prompts: list[list[int]]) -> int:
    """--profile-only: each engine of --runs built fresh, no timed run, and its decode
    step profiled three times; writes pressure_profile.json."""
    args.profile = args.profile or 32
    _, ckpt = dummy_model(args)
    kw = w2_engine_kwargs(args)
    out = {}
    for name in args.runs:
        host_gib = args.host_gib if name == "on" else 0.0
        with built_engine(ckpt, host_kv_size_gib=host_gib, **kw) as llm:
            out[name] = [decode_profile(prompts, args, llm) for _ in range(3)]
            del llm  # freed by built_engine's exit, before the next engine is built
        for i, prof in enumerate(out[name]):
            phases = ", ".join(f"{k} {v:.2f}" for k, v in prof["phase_ms"].items())
            sys.stdout.write(
                f"tier {name:<3} profile {i}: {prof['step_wall_ms']:.3f} ms as run, "
                f"{prof['synced_step_ms']:.3f} ms synced ({phases}) at {prof['batch']} rows\n"
            )
            for line in idle_lines(f"tier {name:<3} profile {i}:", prof.get("gpu_idle")):
                sys.stdout.write(line + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pressure_profile.json").write_text(json.dumps(out, indent=2))
    return 0


def idle_lines(label: str, idle: dict | None) -> list[str]:
    """profiles.gpu_idle's split of a profiled step, as summary lines."""
    if not idle:
        return []
    causes = ", ".join(f"{k} {v:.3f}" for k, v in list(idle["idle_by_cause"].items())[:6])
    lines = [
        f"{label} GPU busy {idle['gpu_busy_ms']:.2f} ms, idle {idle['gpu_idle_ms']:.3f} ms a "
        f"step ({causes}; under 2 us {idle.get('small_gaps_ms', 0.0):.3f})"
    ]
    for key in ("host_ms", "runtime_ms"):
        top = list(idle.get(key, {}).items())[:8]
        if top:
            lines.append(f"{label} {key} a step: " + ", ".join(f"{k} {v:.3f}" for k, v in top))
    if idle.get("streams"):
        items = ", ".join(
            f"stream {k}: {v['activities']:.1f} activities {v['ms']:.3f} ms"
            for k, v in idle["streams"].items()
        )
        lines.append(f"{label} GPU work a step by stream: {items}")
    return lines


def step_kinds(on: list, off: list) -> list[str] | None:
    """Each step's kind where the two runs' timelines ran the same schedule (the same
    count of steps, and the same output tokens and running requests at each; a swap and a
    recompute leave the schedule as it is). A step is a decode step when it computed one
    token per output token (tier-off run's counts), mixed otherwise; "+copy" when the
    tier-on run copied pages at it or at the step before (a copy counts when its
    completion is seen). None when the schedules differ."""
    if len(on) != len(off) or any((a[1], a[3]) != (b[1], b[3]) for a, b in zip(on, off)):
        return None
    kinds = []
    prev_on = prev_off = [0.0, 0, 0, 0, 0]
    copied = [0, 0]
    for a, b in zip(on, off):
        copied = [copied[1], a[4] - prev_on[4]]
        kind = "decode" if b[2] - prev_off[2] == b[1] - prev_off[1] else "mixed"
        kinds.append(kind + ("+copy" if any(copied) else ""))
        prev_on, prev_off = a, b
    return kinds


def step_split(on: list, off: list) -> dict | None:
    """Seconds each run spent on the steps of each kind (step_kinds); None when the
    schedules differ."""
    kinds = step_kinds(on, off)
    if kinds is None:
        return None
    split: dict[str, dict] = {}
    prev_on = prev_off = [0.0, 0, 0, 0, 0]
    for kind, a, b in zip(kinds, on, off):
        cell = split.setdefault(kind, {"steps": 0, "on_s": 0.0, "off_s": 0.0})
        cell["steps"] += 1
        cell["on_s"] += a[0] - prev_on[0]
        cell["off_s"] += b[0] - prev_off[0]
        prev_on, prev_off = a, b
    return split


def phase_split(on: dict, off: dict) -> dict | None:
    """--step-phases: the mean host ms a step of each kind (step_kinds) spent in each of
    engine_runs.PHASES' calls, tier on and off; None when the schedules differ or a run
    has no phases."""
    kinds = step_kinds(on["timeline"], off["timeline"])
    if kinds is None or not on.get("step_phases") or not off.get("step_phases"):
        return None
    # by name: runs recorded by different versions of PHASES share the columns both have
    on_cols, off_cols = on["step_phases"]["columns"], off["step_phases"]["columns"]
    columns = [c for c in on_cols if c in off_cols]
    at_on, at_off = [on_cols.index(c) for c in columns], [off_cols.index(c) for c in columns]
    out: dict[str, dict] = {}
    for kind, a, b in zip(kinds, on["step_phases"]["rows"], off["step_phases"]["rows"]):
        cell = out.setdefault(
            kind, {"steps": 0, "on": [0.0] * len(columns), "off": [0.0] * len(columns)}
        )
        cell["steps"] += 1
        cell["on"] = [x + a[i] for x, i in zip(cell["on"], at_on)]
        cell["off"] = [x + b[i] for x, i in zip(cell["off"], at_off)]
    return {
        kind: {
            name: [round(c["on"][i] / c["steps"], 3), round(c["off"][i] / c["steps"], 3)]
            for i, name in enumerate(columns)
        }
        for kind, c in out.items()
    }


def runs_line(m: dict) -> list[str]:
    """The tier's transfers and their runs of consecutive host pages (a block a layer
    each); none from a pressure.json older than those counters."""
    if not m.get("tier_transfers"):
        return []
    t, r = m["tier_transfers"], m["host_runs"]
    return [f"tier transfers: {t:,}, {r:,} runs of consecutive host pages ({r / t:.2f} a transfer)"]


def phase_lines(split: dict | None) -> list[str]:
    if split is None:
        return []
    return [
        f"host ms a step, {kind:12s} (on/off): "
        + ", ".join(f"{name} {on:.2f}/{off:.2f}" for name, (on, off) in cells.items())
        for kind, cells in sorted(split.items())
    ]


def split_lines(split: dict | None) -> list[str]:
    if split is None:
        return ["steps compared: the two runs' schedules differ"]
    lines = []
    for kind, c in sorted(split.items()):
        diff = c["on_s"] - c["off_s"]
        lines.append(
            f"steps compared, {kind:12s} {c['steps']:5d} steps: tier on {c['on_s']:7.2f} s, "
            f"off {c['off_s']:7.2f} s, on - off {diff:+.2f} s ({1e3 * diff / c['steps']:+.2f} ms a step)"
        )
    return lines


def allocator_line(label: str, run: dict) -> list[str]:
    a = run.get("allocator")
    if not a:
        return []
    return [
        f"{label} device allocator over the run: {a['device_mallocs']} cudaMalloc, "
        f"{a['device_frees']} cudaFree, {a['alloc_retries']} alloc retries, "
        f"{a['segments']} segments, reserved peak {size(a['reserved_peak_bytes'])}"
    ]


def summary(result: dict) -> str:
    on, off = result.get("tier_on"), result.get("tier_off")
    lines = [
        f"{result['workload']} on {result['model']}: {result['requests']} requests, "
        f"{result['prompt_tokens']:,} prompt + {result['expected_output_tokens']:,} output "
        f"tokens, admission {result['admission']}, tier_policy {result['tier_policy']}, "
        f"runs in the order {','.join(result['order'])}",
    ]
    for label, run in (("host tier on ", on), ("host tier off", off)):
        if run is None:
            continue
        m = run["metrics"]
        lines.append(
            f"{label} {run['tok_s']:10.1f} output tok/s ({run['wall_s']:.2f} s, "
            f"{run['output_tokens']:,} tokens)  preemptions {m['preemptions']}  swaps out/in "
            f"{m.get('swaps_out', 0)}/{m.get('swaps_in', 0)}  recomputes {m['recomputes']}  "
            f"computed {m['computed_tokens']:,}"
        )
    profiles = []
    for label, run in (("host tier on ", on), ("host tier off", off)):
        prof = (run or {}).get("after")
        profiles += [(label, prof)]
        profiles += [(f"{label} ({k})", (prof or {}).get(k)) for k in ("emptied", "recaptured")]
    for label, prof in profiles:
        if prof:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in prof["phase_ms"].items())
            replay = prof["replay_gpu_ms"]
            lines.append(
                f"{label} decode step at {prof['batch']} rows "
                f"(context {prof['mean_context']:.0f}): "
                f"{prof['step_wall_ms']:.2f} ms as run, {prof['synced_step_ms']:.2f} ms synced "
                f"({phases}); graph replay " + ("-" if replay is None else f"{replay:.2f} ms")
            )
            lines.extend(idle_lines(label, prof.get("gpu_idle")))
    for label, run in (("host tier on ", on), ("host tier off", off)):
        if run is not None:
            lines.extend(allocator_line(label, run))
            trace = run.get("allocator_trace") or []
            if trace:
                pts = ", ".join(f"{s}: {n}" for s, n, _ in trace[:: max(len(trace) // 12, 1)])
                lines.append(f"{label} allocator segments by step: {pts}")
    if "step_split" in result:
        lines.extend(split_lines(result["step_split"]))
    lines.extend(phase_lines(result.get("phase_split")))
    if on is None:
        lines.append(checks_line(result["checks"]))
        return "\n".join(lines) + "\n"
    m = on["metrics"]
    if cost_rule(m):
        lines.append(f"host tier on: {cost_rule(m)} (tier_policy {result['tier_policy']})")
    if off is not None:
        lines.append(f"ratio on/off {result['ratio']:.2f}x")
    lines += [
        f"tier copies: {size(m['bytes_offloaded'])} to host, {size(m['bytes_loaded'])} back, "
        f"{m['copy_seconds']:.2f} s of copy-stream time -> {m['copy_gb_per_s']:.1f} GB/s = {100 * result['fraction_of_ceiling']:.1f}% of "
        f"{HOST_COPY_GB_S:.0f} GB/s ({result['wall_gb_per_s']:.1f} GB/s over the run's wall time)",
        *runs_line(m),
        f"swap traffic: {size(result['swap_bytes'])} over {result['swap_copy_seconds']:.2f} s of "
        f"copy-stream time -> {result['swap_gb_per_s']:.1f} GB/s = "
        f"{100 * result['swap_gb_per_s'] / HOST_COPY_GB_S:.1f}% of {HOST_COPY_GB_S:.0f} GB/s",
        checks_line(result["checks"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and workload on the CPU")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="device KV pool (GiB)")
    ap.add_argument("--host-gib", type=float, default=64.0, help="host KV pool of the tier-on run")
    ap.add_argument("--decode-append", default="off", choices=("off", "batched", "layer"))
    ap.add_argument(
        "--runs",
        type=parse_runs,
        default=["on", "off"],
        help="the engines to build, in order: on,off (default), off,on, on or off",
    )
    ap.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=32,
        default=None,
        metavar="ROWS",
        help="after each timed run, where a decode step of ROWS requests (default 32, about "
        "as many as W2's pool holds) spends its time: profiles.profile_decode",
    )
    ap.add_argument(
        "--profile-only",
        action="store_true",
        help="no timed run: build each engine of --runs on its own and profile a decode "
        "step of --profile rows (32) three times on the fresh engine (the first captures "
        "its graph); the tier's own per-step cost, apart from what a run leaves behind",
    )
    ap.add_argument(
        "--pin-gib",
        type=float,
        default=0.0,
        help="host memory pinned as the tier's pool is, held through every run (GPU only)",
    )
    ap.add_argument(
        "--profile-emptied",
        action="store_true",
        help="with --profile, on the GPU: then release the allocator's cached memory "
        "(torch.cuda.empty_cache) and profile the step again, to tell whether what the run "
        "left in the allocator slows the step",
    )
    ap.add_argument(
        "--profile-recaptured",
        action="store_true",
        help="with --profile: then capture the decode graphs again and profile the step "
        "once more, to tell whether the graphs captured before the run are what runs slower",
    )
    ap.add_argument(
        "--step-phases",
        action="store_true",
        help="time each step's host calls (engine_runs.PHASES: schedule, swap_out, flush, "
        "poll, launch, execute, the wait for the tokens, and the tier's calls inside flush) "
        "in the timed runs; with both runs, their means a step by step kind (phase_split)",
    )
    ap.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="PRESSURE_JSON",
        help="another process's pressure.json of the same workload: its run of the engine "
        "this process did not build joins the step-by-step comparison (step_split)",
    )
    add_engine_args(ap)
    add_model_args(ap)
    add_policy_args(ap)
    args = ap.parse_args(argv)
    ballast = pinned_ballast(args.pin_gib)  # noqa: F841  (held until main returns)
    if args.small:
        prompts, out_lens = small_workload()
        args.host_gib, warmup_len = 0.002, 16
    else:
        prompts, out_lens = w2_requests()
        warmup_len = 512
    if args.profile_only:
        return profile_only(args, prompts)
    _, ckpt = dummy_model(args)
    kw = w2_engine_kwargs(args)
    runs = {}
    for name in args.runs:
        host_gib = args.host_gib if name == "on" else 0.0
        after = partial(decode_profile, prompts, args) if args.profile else None
        runs[name] = timed_run(
            ckpt,
            prompts,
            out_lens,
            warmup_len,
            after=after,
            phases=args.step_phases,
            host_kv_size_gib=host_gib,
            **kw,
        )
    on, off = runs.get("on"), runs.get("off")
    checks = {
        "all_outputs": all(r["all_outputs"] for r in runs.values()),
        "same_output_tokens": all(r["output_tokens"] == sum(out_lens) for r in runs.values()),
    }
    if off is not None:
        checks["tier_off_recomputed"] = off["metrics"]["recomputes"] > 0
    if args.tier_policy == "always" and on is not None:
        checks["tier_on_swapped"] = on["metrics"].get("swaps_out", 0) > 0
    result = {
        "workload": "small" if args.small else "W2",
        "model": args.model + (" (small)" if args.small else ""),
        "admission": args.admission,
        "tier_policy": args.tier_policy,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "expected_output_tokens": sum(out_lens),
        "engine": dict(kw, host_kv_size_gib=args.host_gib),
        "order": args.runs,
        "ceiling_gb_per_s": HOST_COPY_GB_S,
        "checks": checks,
    }
    if off is not None:
        result["tier_off"] = off
    other = json.loads(args.against.read_text()) if args.against is not None else {}
    on_run, off_run = on or other.get("tier_on"), off or other.get("tier_off")
    if on_run and off_run and "timeline" in on_run and "timeline" in off_run:
        result["step_split"] = step_split(on_run["timeline"], off_run["timeline"])
        if args.step_phases:
            result["phase_split"] = phase_split(on_run, off_run)
    if on is not None:
        m = on["metrics"]
        moved = m["bytes_offloaded"] + m["bytes_loaded"]
        # the swap traffic alone (swap-outs and swap-ins, not write-through or appends)
        swap_bytes = m.get("bytes_swap_out", 0) + m.get("bytes_swap_in", 0)
        swap_seconds = m.get("copy_seconds_swap_out", 0.0) + m.get("copy_seconds_swap_in", 0.0)
        result.update(
            tier_on=on,
            fraction_of_ceiling=m["copy_gb_per_s"] / HOST_COPY_GB_S,
            wall_gb_per_s=moved / on["wall_s"] / 1e9,
            swap_bytes=swap_bytes,
            swap_copy_seconds=swap_seconds,
            swap_gb_per_s=swap_bytes / swap_seconds / 1e9 if swap_seconds > 0 else 0.0,
        )
        if off is not None:
            result["ratio"] = on["tok_s"] / off["tok_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pressure.json").write_text(json.dumps(result, indent=2))
    sys.stdout.write(summary(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
