"""W3 `shared-prefix`: few-shot evaluation shape; batchgen's defaults vs recompute.

On the GPU (from the repository root). Device time per engine: building it (warm-up,
CUDA graphs, and for tier-on runs pinning the 64 GiB host pool) ~20-30 s, plus the timed
part: W1's model ~30-40 s for the arrival-order runs, less for the others; W3-8B ~3 min
for the baseline (6.35M prompt tokens recomputed), ~1-1.5 min for tier-on-arrival, ~0.5-1
min each for defaults and tier-off-prefix.

    # W3, W1's model, all four runs: ~4 min
    PYTHONPATH=src python3 -m benchmarks.shared_prefix --out $OUT
    # W3-8B, all four runs: ~8-9 min, close to a 10-minute limit per command
    PYTHONPATH=src python3 -m benchmarks.shared_prefix --model llama-3.1-8b --out $OUT
    # W3-8B in two calls instead: the headline (~4.5 min), then the other two runs
    # (~3 min; --profile adds ~30 s: the trace of tier-on-arrival, the first tier-on run)
    PYTHONPATH=src python3 -m benchmarks.shared_prefix --model llama-3.1-8b --runs defaults,baseline --out $OUT/a
    PYTHONPATH=src python3 -m benchmarks.shared_prefix --model llama-3.1-8b --runs tier-off-prefix,tier-on-arrival --profile --out $OUT/b
    # CPU, seconds, for CI
    PYTHONPATH=src python3 -m benchmarks.shared_prefix --small --out /tmp/w3

--model: qwen3-0.6b (W1's model, the default) or llama-3.1-8b (W3-8B), random bf16
weights drawn on the GPU (load_format="dummy": the model directory, --ckpt or
/tmp/batchgen-<model>-config, holds only config.json and a placeholder tokenizer).
2048 requests from workloads.w3_requests(): 64 prefixes of 3,000 random tokens x 32
questions of 100, 16 output tokens each (greedy, ignore_eos), device KV pool 4 GiB
(--kv-gib), host pool 64 GiB (--host-gib) for the tier-on runs. The requests arrive
round-robin over the prefixes (question q of every prefix before question q + 1 of any):
in arrival order each prefix returns only after the 63 others, while the 4 GiB pool holds
about 12 requests' worth of pages (10 for W3-8B), so every prefix is evicted from the
device before its next use.

Up to four engines, one after the other in one process (each freed before the next;
--runs picks a subset and their order, by default this one):

    defaults         batchgen's defaults: admission="prefix", host tier on, tier_policy
                     (--tier-policy, default the engine's "auto")
    baseline         recompute: host tier off, admission="arrival" (what vLLM does
                     without offload): an evicted prefix is computed again
    tier-off-prefix  host tier off, admission="prefix"
    tier-on-arrival  host tier on (tier_policy as above), admission="arrival"

The headline is defaults vs baseline; tier on vs off is compared under each admission
and prefix vs arrival under each tier setting, for every pair whose two runs ran. Per run
it prints output tok/s, wall time, prefill tokens computed (all computed tokens but one
decode token per output after a request's first), device and host prefix hits and
preemptions, and for tier-on runs the prefix-load traffic alone (bytes_prefix_load over
copy_seconds_prefix_load) in GB/s and as a fraction of 55 GB/s.

--model kimi-w6 (W6's hybrid architecture) and --checkpoint-interval TOKENS: the cost of
a hybrid model's state checkpoints (issue: Kimi-K3-class hybrids). A prefix hit needs the
KDA state at the hit's end, so a prefix is reusable only up to its last checkpoint
(every state_checkpoint_interval tokens, a multiple of the page size; 0: none, every
prompt computed whole). Per run it prints the checkpoints stored, their bytes and
copy-stream time, the bytes loaded back and the prompt tokens they let hits skip; one
process per interval (each its own engine):

    for i in 0 256 512 1024; do PYTHONPATH=src python3 -m benchmarks.shared_prefix \
        --model kimi-w6 --runs defaults --checkpoint-interval $i --out $OUT/ck$i; done

--checkpoint-policy shared|all sets state_checkpoint_policy (default: the engine's,
"shared": only positions another request of the batch reaches are stored); "all" stores
every position, as the engine did before, to measure what the policy saves.

--profile: after the timed part of the first tier-on run (or of each run --profile-runs
names), the first 128 requests of the workload are submitted again (their prefixes are
then mostly on the host only) and a torch.profiler trace of CPU and CUDA activity is
taken over up to --profile-steps steps; from its events: the time host->device copies
were active on the copy streams, the fraction of it during which a kernel ran on the
compute stream (the stream with the most kernel time), that stream's busy time and its
kernels by family (profiles.kernel_families), and the host milliseconds per step in
each of batchgen's step phases (schedule, prepare, forward, sample, update, replay; copy:
the copy workers issuing copies). Comparing a tier-on and a tier-off run this way says
where a host-bound run's time goes. The trace is kept as shared_prefix_trace.json (one
run) or shared_prefix_trace_<run>.json in --out. Skipped, with a message, on the CPU. A
tier the cost rule left idle (tier_policy "auto", printed per run) loads nothing to
trace: --tier-policy always makes it load.

Writes shared_prefix.json into --out; exits 1 when a run lost output tokens, the
defaults did not compute fewer prefill tokens than the baseline, or (tier_policy
"always") the tier-on-arrival run had no host prefix hit.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from benchmarks.card import HOST_COPY_GB_S
from benchmarks.engine_runs import (
    add_engine_args,
    add_model_args,
    add_policy_args,
    checks_line,
    comma_list,
    cost_rule,
    dummy_model,
    engine_kwargs,
    policy_kwargs,
    size,
    timed_run,
)
from benchmarks.profiles import kernel_families
from benchmarks.workloads import w3_requests

# name: (admission, host tier on)
RUNS = {
    "defaults": ("prefix", True),
    "baseline": ("arrival", False),
    "tier-off-prefix": ("prefix", False),
    "tier-on-arrival": ("arrival", True),
}

# name: (a, b). Reported: output tok/s a / b, prefill tokens computed b / a, wall time
# b / a (each above 1 when a is the better run)
RATIOS = {
    "defaults_vs_baseline": ("defaults", "baseline"),
    "tier_on_vs_off_prefix": ("defaults", "tier-off-prefix"),
    "tier_on_vs_off_arrival": ("tier-on-arrival", "baseline"),
    "prefix_vs_arrival_tier_on": ("defaults", "tier-on-arrival"),
    "prefix_vs_arrival_tier_off": ("tier-off-prefix", "baseline"),
}


def small_workload() -> tuple[list[list[int]], list[int]]:
    """W3 scaled to the CPU: 8 prefixes of 96 tokens (6 pages) x 4 questions of 8 tokens,
    4 output tokens each; with a 16-page device pool about two prefixes fit at a time."""
    return w3_requests(
        num_prefixes=8, num_questions=4, prefix_len=96, question_len=8, out_len=4, max_token=500
    )


def w3_engine_kwargs(args) -> dict:
    kw = engine_kwargs(args) | policy_kwargs(args)
    if args.checkpoint_interval is not None:
        kw["state_checkpoint_interval"] = args.checkpoint_interval
    if args.checkpoint_policy is not None:
        kw["state_checkpoint_policy"] = args.checkpoint_policy
    if args.small:
        return dict(kw, device="cpu", dtype="float32", max_model_len=96 + 8 + 4, num_kv_pages=16)
    return dict(
        kw, device="cuda", dtype="bfloat16", max_model_len=3100 + 16, kv_cache_size_gib=args.kv_gib
    )


def parse_runs(text: str) -> list[str]:
    """A comma list of RUNS names -> those names, each once, in the order given (the
    first engine of a process pays for memory later ones reuse: name the order, or run
    one engine per process, to compare runs fairly)."""
    return comma_list(text, RUNS, f"--runs takes a comma list of {', '.join(RUNS)}")


def prefix_load_rate(metrics: dict) -> dict:
    """The prefix-load traffic alone: bytes, copy-stream seconds, GB/s, fraction of 55."""
    nbytes = metrics.get("bytes_prefix_load", 0)
    secs = metrics.get("copy_seconds_prefix_load", 0.0)
    rate = nbytes / secs / 1e9 if secs > 0 else 0.0
    return {
        "bytes": nbytes,
        "copy_seconds": secs,
        "gb_per_s": rate,
        "fraction_of_ceiling": rate / HOST_COPY_GB_S,
    }


def ratios(runs: dict) -> dict:
    """Every RATIOS entry whose two runs ran."""
    out = {}
    for name, (a, b) in RATIOS.items():
        if a in runs and b in runs:
            ra, rb = runs[a], runs[b]
            pa = ra["metrics"]["prefill_tokens_computed"]
            pb = rb["metrics"]["prefill_tokens_computed"]
            out[name] = {
                "runs": [a, b],
                "tok_s": ra["tok_s"] / rb["tok_s"],
                "prefill_computed": pb / max(pa, 1),
                "wall_s": rb["wall_s"] / ra["wall_s"],
            }
    return out


# ---- --profile: host->device copies against compute, from a torch.profiler trace ---------


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def measure(spans: list[tuple[float, float]]) -> float:
    """Total length of merged intervals."""
    return sum(end - start for start, end in spans)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list:
    """The intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def copy_overlap(events: list[dict]) -> dict:
    """Host->device copies against compute, from a Chrome trace's GPU events (torch
    profiler, CUDA activity: "kernel" and "gpu_memcpy" complete events, microseconds).

    The compute stream is the stream with the most kernel time; the copy streams are the
    other streams with host->device memcpy. Reported: the time copies were active on the
    copy streams (per stream, overlapping copies counted once), the part of it during
    which a kernel ran on the compute stream, the compute stream's busy time, its kernels
    by family, and the host->device copies on the compute stream (input uploads)."""
    kernels: dict = {}
    copies: dict = {}
    copy_bytes: dict = {}
    rows: dict = {}
    for e in events:
        cat = e.get("cat")
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy"):
            continue
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        if cat == "kernel":
            kernels.setdefault(stream, []).append(span)
            rows.setdefault(stream, []).append((e.get("name", ""), (span[1] - span[0]) / 1000))
        elif "HtoD" in e.get("name", ""):
            copies.setdefault(stream, []).append(span)
            copy_bytes[stream] = copy_bytes.get(stream, 0) + int(
                (e.get("args") or {}).get("bytes", 0)
            )
    if not kernels:
        return {"error": "the trace has no kernel events"}
    compute = max(kernels, key=lambda s: measure(union(kernels[s])))
    busy = union(kernels[compute])
    copy_us = overlap_us = 0.0
    nbytes = count = 0
    for stream, spans in copies.items():
        if stream == compute:
            continue
        active = union(spans)
        copy_us += measure(active)
        overlap_us += measure(intersect(active, busy))
        nbytes += copy_bytes[stream]
        count += len(spans)
    spans = [s for v in (*kernels.values(), *copies.values()) for s in v]
    return {
        "compute_stream": compute,
        "copy_streams": sorted((s for s in copies if s != compute), key=str),
        "window_ms": (max(e for _, e in spans) - min(s for s, _ in spans)) / 1000,
        "compute_ms": measure(busy) / 1000,
        "htod_copy_ms": copy_us / 1000,
        "htod_overlapped_ms": overlap_us / 1000,
        "overlap_fraction": overlap_us / copy_us if copy_us else 0.0,
        "htod_copies": count,
        "htod_bytes": nbytes,
        "htod_gb_per_s": nbytes / copy_us / 1e3 if copy_us else 0.0,
        "htod_on_compute_stream_ms": measure(union(copies.get(compute, []))) / 1000,
        "compute_ms_by_family": kernel_families(rows[compute]),
    }


def profile_prefix_loads(
    llm, *, prompts, out_lens, num_requests: int, steps: int, out: Path, name: str = ""
) -> dict:
    """Trace up to `steps` steps of the first num_requests requests of the workload, run
    again after the timed part, and measure copy/compute overlap in the trace and the
    host time of batchgen's step phases (its record_function ranges)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from batchgen import SamplingParams

    eng = llm.engine
    tier = eng.tier

    def loaded() -> int:
        return 0 if tier is None else tier.metrics.bytes_by_reason.get("prefix_load", 0)

    for i in range(min(num_requests, len(prompts))):
        params = SamplingParams(temperature=0, max_tokens=out_lens[i], ignore_eos=True)
        eng.add_request(f"profile{i}", prompts[i], params)
    before = loaded()
    done = 0
    torch.cuda.synchronize(eng.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while eng.has_unfinished and done < steps:
            eng.step()
            done += 1
        eng._drain()  # the queued decode step's GPU work inside the window
        if tier is not None:
            tier.drain()
        torch.cuda.synchronize(eng.device)
    nbytes = loaded() - before
    eng.abort(list(eng.requests))
    if tier is not None:
        tier.drain()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"shared_prefix_trace{'_' + name if name else ''}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    report = copy_overlap(events)
    return dict(
        report,
        host_ms_per_step=host_ranges(events, max(done, 1)),
        steps=done,
        prefix_load_bytes=nbytes,
        trace=str(trace),
    )


def host_ranges(events: list[dict], steps: int) -> dict[str, float]:
    """Host milliseconds per step in each batchgen.* record_function range (Chrome-trace
    "user_annotation" events), and "copy_issue" for the copy workers' batchgen.copy."""
    totals: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        if (
            e.get("ph") == "X"
            and e.get("cat") == "user_annotation"
            and name.startswith("batchgen.")
        ):
            key = name.removeprefix("batchgen.")
            totals[key] = totals.get(key, 0.0) + float(e.get("dur", 0.0)) / 1000
    return {k: round(v / steps, 3) for k, v in sorted(totals.items())}


# ---- the script -----------------------------------------------------------------------


def run_line(name: str, run: dict) -> str:
    m = run["metrics"]
    return (
        f"{name:<16} {run['admission']:<8} {'on ' if run['host_tier'] else 'off'} "
        f"{run['tok_s']:10.1f} {run['wall_s']:8.2f} {m['prefill_tokens_computed']:>12,} "
        f"{m['prefix_hit_tokens']:>12,} {m.get('host_prefix_hit_tokens', 0):>12,} "
        f"{m['preemptions']:>6}"
    )


def summary(result: dict) -> str:
    lines = [
        f"{result['workload']} on {result['model']}: {result['requests']} requests "
        f"({result['prefixes']} prefixes x {result['questions']} questions, round-robin), "
        f"{result['prompt_tokens']:,} prompt + {result['expected_output_tokens']:,} output "
        f"tokens, tier_policy {result['tier_policy']}",
        f"{'run':<16} {'admit':<8} tier {'tok/s':>9} {'wall s':>8} {'prefill comp.':>12} "
        f"{'device hits':>12} {'host hits':>12} {'preempt':>6}",
    ]
    runs = result["runs"]
    lines += [run_line(name, run) for name, run in runs.items()]
    for name, run in runs.items():
        if run["host_tier"]:
            m, load = run["metrics"], run["prefix_load"]
            lines.append(
                f"{name}: prefix loads {size(load['bytes'])} over {load['copy_seconds']:.2f} s "
                f"of copy-stream time -> {load['gb_per_s']:.1f} GB/s = "
                f"{100 * load['fraction_of_ceiling']:.1f}% of {HOST_COPY_GB_S:.0f} GB/s; all tier "
                f"copies {size(m['bytes_loaded'])} host->device, {size(m['bytes_offloaded'])} "
                f"device->host; {cost_rule(m)}"
            )
    for name, run in runs.items():
        m = run["metrics"]
        if "state_swaps_out" in m:  # a model with linear-attention layers
            lines.append(
                state_checkpoint_line(
                    name, m, result.get("checkpoint_interval"), result.get("checkpoint_policy")
                )
            )
    for name, r in result["ratios"].items():
        a, b = r["runs"]
        lines.append(
            f"{name}: output tok/s {a} / {b} {r['tok_s']:.2f}x, prefill tokens computed "
            f"{b} / {a} {r['prefill_computed']:.2f}x"
        )
    profiles = result.get("profiles") or (
        {result["profile"].get("run", ""): result["profile"]} if result.get("profile") else {}
    )
    for prof in profiles.values():
        lines += profile_lines(prof)
    lines.append(checks_line(result["checks"]))
    return "\n".join(lines) + "\n"


def state_checkpoint_line(name: str, m: dict, interval, policy=None) -> str:
    """A hybrid model's prefix reuse: the state checkpoints stored (what they cost in
    copies) and the prompt tokens they let a prefix hit skip."""
    stored, loaded = m.get("bytes_state_checkpoint", 0), m.get("bytes_state_checkpoint_load", 0)
    secs = m.get("copy_seconds_state_checkpoint", 0.0)
    rate = f"{stored / secs / 1e9:.1f} GB/s" if secs > 0 else "-"
    every = "engine default" if interval is None else f"{interval} tokens"
    return (
        f"{name}: state checkpoints every {every}: {m.get('state_checkpoints', 0):,} stored "
        f"({size(stored)} over {secs:.2f} s of copy-stream time, {rate}), {size(loaded)} "
        f"loaded back; prefix hits through them {m.get('state_checkpoint_hit_tokens', 0):,} "
        f"tokens; policy {policy or 'the engine default'}"
    )


def profile_lines(prof: dict) -> list[str]:
    if "skipped" in prof:
        return [f"profile: skipped: {prof['skipped']}"]
    if "error" in prof:
        return [f"profile: {prof['error']}"]
    lines = [
        f"profile ({prof['run']}, {prof['steps']} steps, {prof['window_ms']:.1f} ms, "
        f"{size(prof['prefix_load_bytes'])} of prefix loads): host->device copies "
        f"active {prof['htod_copy_ms']:.2f} ms ({size(prof['htod_bytes'])}, "
        f"{prof['htod_gb_per_s']:.1f} GB/s), {100 * prof['overlap_fraction']:.1f}% "
        f"of it under compute kernels ({prof['htod_overlapped_ms']:.2f} ms); compute "
        f"stream busy {prof['compute_ms']:.2f} ms; trace {prof['trace']}"
    ]
    host = prof.get("host_ms_per_step")
    if host:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in host.items())
        lines.append(f"profile ({prof['run']}): host ms per step: {parts}")
    if not prof["prefix_load_bytes"] and prof.get("host_tier", True):
        lines.append(
            "profile: no prefix load in the window (an idle tier? see the cost "
            "rule above; --tier-policy always loads regardless)"
        )
    return lines


def checks(runs: dict, expected: int, tier_policy: str) -> dict[str, bool]:
    out = {
        "all_outputs": all(r["all_outputs"] for r in runs.values()),
        "same_output_tokens": all(r["output_tokens"] == expected for r in runs.values()),
    }
    prefill = {name: r["metrics"]["prefill_tokens_computed"] for name, r in runs.items()}
    if "defaults" in runs and "baseline" in runs:
        out["defaults_fewer_prefill_than_baseline"] = prefill["defaults"] < prefill["baseline"]
    if tier_policy == "always" and "tier-on-arrival" in runs:
        hits = runs["tier-on-arrival"]["metrics"].get("host_prefix_hit_pages", 0)
        out["tier_on_arrival_host_prefix_hits"] = hits > 0
    return out


def profile_target(args, device: str) -> tuple[list[str], str | None]:
    """(the runs --profile traces, None) or ([], why it is skipped); ([], None) without
    --profile. --profile-runs names them; by default the first tier-on run."""
    if not args.profile:
        return [], None
    if device == "cpu":
        return [], (
            "--profile traces CUDA activity (copy streams against compute kernels); this "
            "run is on the CPU"
        )
    if args.profile_runs:
        return [name for name in args.runs if name in args.profile_runs], None
    tier_on = [name for name in args.runs if RUNS[name][1]]
    if not tier_on:
        return [], "--profile traces a tier-on run; none of --runs has the host tier on"
    return tier_on[:1], None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and workload on the CPU")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="device KV pool (GiB)")
    ap.add_argument("--host-gib", type=float, default=64.0, help="host KV pool of tier-on runs")
    ap.add_argument(
        "--runs",
        type=parse_runs,
        default=list(RUNS),
        help=f"comma list of runs (default all): {', '.join(RUNS)}",
    )
    ap.add_argument("--profile", action="store_true", help="trace the first tier-on run (GPU)")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument(
        "--profile-runs",
        type=parse_runs,
        default=None,
        help="with --profile: the runs to trace (default the first tier-on run)",
    )
    ap.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        metavar="TOKENS",
        help="state_checkpoint_interval of every run (models with linear-attention layers; "
        "0: off; default: the engine's)",
    )
    ap.add_argument(
        "--checkpoint-policy",
        choices=("shared", "all"),
        default=None,
        help="state_checkpoint_policy of every run (default: the engine's)",
    )
    add_engine_args(ap)
    add_model_args(ap)
    add_policy_args(ap, admission=False)
    args = ap.parse_args(argv)
    if args.small:
        prompts, out_lens = small_workload()
        args.host_gib, warmup_len, prefixes, questions = 0.002, 16, 8, 4
    else:
        prompts, out_lens = w3_requests()
        warmup_len, prefixes, questions = 512, 64, 32
    _, ckpt = dummy_model(args)
    kw = w3_engine_kwargs(args)
    profile_runs, skipped = profile_target(args, kw["device"])
    profile = {"skipped": skipped} if skipped else None
    profiles = {}
    runs = {}
    for name in args.runs:
        admission, tier = RUNS[name]
        after = None
        if name in profile_runs:
            after = partial(
                profile_prefix_loads,
                prompts=prompts,
                out_lens=out_lens,
                num_requests=2 * prefixes,
                steps=args.profile_steps,
                out=args.out,
                name=name if len(profile_runs) > 1 else "",
            )
        run = timed_run(
            ckpt,
            prompts,
            out_lens,
            warmup_len,
            after=after,
            admission=admission,
            host_kv_size_gib=args.host_gib if tier else 0.0,
            **kw,
        )
        if name in profile_runs:
            profiles[name] = dict(run.pop("after"), run=name, host_tier=tier)
            profile = profile or profiles[name]
        run.update(admission=admission, host_tier=tier)
        if tier:
            run["prefix_load"] = prefix_load_rate(run["metrics"])
        runs[name] = run
    result = {
        "workload": "small" if args.small else "W3",
        "model": args.model + (" (small)" if args.small else ""),
        "tier_policy": args.tier_policy,
        "checkpoint_interval": args.checkpoint_interval,
        "checkpoint_policy": args.checkpoint_policy,
        "requests": len(prompts),
        "prefixes": prefixes,
        "questions": questions,
        "order": "round-robin over prefixes: request k is question k // prefixes of prefix "
        "k % prefixes",
        "prompt_tokens": sum(len(p) for p in prompts),
        "expected_output_tokens": sum(out_lens),
        "engine": dict(kw, host_kv_size_gib=args.host_gib),
        "ceiling_gb_per_s": HOST_COPY_GB_S,
        "runs": runs,
        "ratios": ratios(runs),
        "checks": checks(runs, sum(out_lens), args.tier_policy),
    }
    if profile is not None:
        result["profile"] = profile
    if len(profiles) > 1:
        result["profiles"] = profiles
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prefix.json").write_text(json.dumps(result, indent=2))
    sys.stdout.write(summary(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
