"""W1 `nano`: batchgen vs transformers' continuous batching (paged|sdpa) in one run.

    python3 -m benchmarks.throughput                 # W1 on the GPU, peer beside it
    python3 -m benchmarks.throughput --skip-peer     # while iterating (not a result)
    python3 -m benchmarks.throughput --small         # CPU, seconds, for CI
    python3 -m benchmarks.throughput --profile       # + where a decode step's time goes
    python3 -m benchmarks.throughput --sampling all  # sampled decoding beside greedy

--sampling greedy|sampled|top_k|penalty|all: batchgen alone (no peer), one engine, the
workload run greedy first and then as asked: `sampled` temperature 0.8 + top_p 0.95 with
a seed per request, `top_k` that + top_k 50, `penalty` that + repetition_penalty 1.1
(`all`: the three); prints each run's output tok/s and its ratio to greedy, writes
sampling.json. Each run's prompts start with their own first token, so no run takes
pages from the prefix cache an earlier one left.

Prints output tok/s for both, their ratio and batchgen's fraction of the roofline
(roofline.py); writes throughput.json and throughput.png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.engine_runs import add_engine_args, engine_kwargs, gc_pauses
from benchmarks.roofline import roofline_seconds
from benchmarks.workloads import (
    QWEN3_0_6B,
    SMALL_MODEL,
    random_checkpoint,
    small_requests,
    w1_requests,
)


def _warm_llm(ckpt, prompts, args):
    """batchgen's LLM on `ckpt` as args configure it, warmed up on the first prompts
    (kernels compiled, CUDA graphs captured) so that timing starts after them."""
    from batchgen import LLM, SamplingParams

    llm = LLM(
        model=str(ckpt),
        dtype=args.dtype,
        device=args.device,
        max_model_len=2048,
        **engine_kwargs(args),
    )
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    return llm


def run_batchgen(ckpt, prompts, out_lens, args):
    from batchgen import SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    llm = _warm_llm(ckpt, prompts, args)
    eng = llm.engine
    _sync(args.device)
    with fewer_full_collections():  # as LLM.generate runs
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            eng.add_request(
                f"w{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            )
        # per step: seconds, output tokens so far, tokens computed so far, running requests
        timeline = []
        out0, computed0 = eng.stats.output_tokens, eng.scheduler.num_computed_tokens_total
        while eng.has_unfinished:
            eng.step()
            timeline.append(
                (
                    time.perf_counter() - start,
                    eng.stats.output_tokens - out0,
                    eng.scheduler.num_computed_tokens_total - computed0,
                    len(eng.scheduler.running),
                )
            )
    _sync(args.device)
    wall = time.perf_counter() - start
    out = sum(out_lens)
    result = {
        "wall_s": wall,
        "output_tokens": out,
        "tok_s": out / wall,
        "cuda_graphs": eng.runner.graphs is not None,
        "steps": eng.stats.steps,
        "metrics": eng.metrics(),
        "backend": eng.runner.attention_backend,
        "timeline": [[round(t, 4), o, c, r] for t, o, c, r in timeline],
    }
    if args.profile:
        result["profile"] = profile_decode(llm, prompts, args)
    return result, timeline


SAMPLING = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "top_k": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "penalty": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1},
}


def run_sampling(ckpt, prompts, out_lens, args) -> dict:
    """The workload greedy, then under each asked SAMPLING configuration, in one engine
    (a seed per request): {name: {wall_s, output_tokens, tok_s, ratio_to_greedy}}."""
    from batchgen import SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    llm = _warm_llm(ckpt, prompts, args)
    eng = llm.engine
    names = ["greedy"] + (list(SAMPLING)[1:] if args.sampling == "all" else [args.sampling])
    results: dict[str, dict] = {}
    for k, name in enumerate(dict.fromkeys(names)):
        _sync(args.device)
        out0 = eng.stats.output_tokens
        with fewer_full_collections():
            start = time.perf_counter()
            for i, (p, n) in enumerate(zip(prompts, out_lens)):
                params = SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **SAMPLING[name])
                eng.add_request(f"{name}{i}", [k + 1, *p[1:]], params)
            while eng.has_unfinished:
                eng.step()
        _sync(args.device)
        wall = time.perf_counter() - start
        out = eng.stats.output_tokens - out0
        results[name] = {"wall_s": wall, "output_tokens": out, "tok_s": out / wall}
        results[name]["ratio_to_greedy"] = results[name]["tok_s"] / results["greedy"]["tok_s"]
    return results


def profile_decode(llm, prompts, args, max_tokens: int = 300):
    """Where a decode step's time goes at batch max_num_seqs (the engine's), three ways:

    - ``step_wall_ms``: steps as the benchmark runs them (pipelined decode if on);
    - ``phase_ms``: unpipelined steps with a device sync around each phase (schedule,
      input prep + forward, logits, sampling, update), so each phase owns its GPU time;
    - ``kernels``: the GPU kernels of plain steps by name (torch profiler), heaviest
      first, summed by family in ``gpu_ms_by_family`` (attention, gemm, norm_rope_act,
      sampling, copies, other), and ``replay_gpu_ms``: one decode graph replay alone,
      timed with events (``input_prep_ms``: the forward phase's host time around it).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from batchgen import SamplingParams

    eng = llm.engine
    rows = args.max_num_seqs or eng.config.max_num_seqs  # None: the engine's, for the device
    for i, p in enumerate(prompts[:rows]):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)  # W1: 300
        eng.add_request(f"prof{i}", p, params)
    for _ in range(200):  # every prompt prefilled: profile pure decode steps
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.requests.values()):
            break
        eng.step()
    steps = 16
    _sync(args.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(args.device)
    wall_ms = (time.perf_counter() - t0) * 1000 / steps

    phases: dict[str, float] = {}
    runner, sched = eng.runner, eng.scheduler
    pipeline, eng._pipeline = eng._pipeline, False  # phases of plain steps
    eng._drain()
    targets = [
        (sched, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (runner, "_replay", "forward"),
        (runner.model, "forward", "forward"),
        (runner.model, "compute_logits", "logits"),
        (runner, "_sample", "sample"),
        (sched, "update", "update"),
    ]
    saved = []
    for obj, name, phase in targets:
        fn = getattr(obj, name)
        saved.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, _synced(fn, phase, phases, args.device))
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    synced_ms = (time.perf_counter() - t0) * 1000 / steps
    for obj, name, old in saved:
        if old is None:
            delattr(obj, name)
        else:
            setattr(obj, name, old)
    eng._pipeline = pipeline
    phase_ms = {k: v * 1000 / steps for k, v in phases.items()}
    phase_ms["rest"] = synced_ms - sum(phase_ms.values())

    kernels, families, idle = [], {}, None
    if args.device != "cpu":
        # pipelined steps: settle the queue on both sides, so the window holds whole steps
        eng._drain()
        _sync(args.device)
        first = eng.stats.steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                eng.step()
            eng._drain()
            _sync(args.device)
        kernels, families = kernel_table(prof, max(eng.stats.steps - first, 1))
        idle = idle_profile(eng, args.device)
    replay_ms = None
    graphs = runner.graphs
    if graphs is not None and graphs.graphs:
        bs = max(graphs.graphs)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graphs.graphs[bs].replay()
        stop.record()
        stop.synchronize()
        replay_ms = start.elapsed_time(stop) / 10
    ctx = [r.num_tokens for r in eng.requests.values()]
    eng.abort(list(eng.requests))
    return {
        "batch": len(ctx),
        "mean_context": sum(ctx) / max(len(ctx), 1),
        "step_wall_ms": wall_ms,
        "synced_step_ms": synced_ms,
        "phase_ms": phase_ms,
        "replay_gpu_ms": replay_ms,
        "gpu_ms_by_family": families,
        # graph steps: the forward phase less the replay's GPU time; eager: prepare()
        "input_prep_ms": (
            phase_ms.get("forward", 0.0) - replay_ms
            if replay_ms is not None
            else phase_ms.get("prepare", 0.0)
        ),
        "kernels": kernels,
        "gpu_idle": idle,
    }


def idle_profile(eng, device: str, steps: int = 8) -> dict:
    """gpu_idle over `steps` steps as the engine runs them (pipelined if on), recorded
    with host and GPU activities."""
    from torch.profiler import ProfilerActivity, profile

    eng._drain()
    _sync(device)
    first = eng.stats.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        eng._drain()
        _sync(device)
    return gpu_idle(trace_events(prof), max(eng.stats.steps - first, 1))


def trace_events(prof) -> list[dict]:
    """A finished torch profiler's events, as its Chrome trace holds them."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())["traceEvents"]


def kernel_table(prof, steps: int) -> tuple[list[str], dict[str, float]]:
    """A torch profiler's GPU kernels per step, heaviest first (the top 25 as text
    lines), and their time summed by family."""
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0) or 0
        if dev_us:
            rows.append((dev_us / 1000 / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    kernels = [f"{ms:7.3f} ms  x{n:<6.1f} {name[:70]}" for ms, n, name in rows[:25]]
    return kernels, kernel_families([(name, ms) for ms, _, name in rows])


def profile_prefill(llm, prompts, steps: int = 3) -> dict:
    """Where a prefill step's time goes: every prompt added (one output token each),
    one step to warm up, then `steps` steps timed as run (each a chunk of up to
    max_num_batched_tokens prompt tokens) and, on a GPU, two more under the torch
    profiler: their kernels by name and by family, and the GPU's idle time between them
    (gpu_idle; GPU activities only, so the causes it names are "device" or the launch
    calls, the host's ranges not recorded), then one more with the host's side of it
    (`host_side`: its synchronizing CUDA calls by Python site, and its Python time by
    function). Each prompt's first token is changed,
    so that no page hits the prefix cache an earlier run left. The requests are aborted
    after."""
    from torch.profiler import ProfilerActivity, profile

    from batchgen import SamplingParams

    eng = llm.engine
    device = eng.device.type
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        first = p[0] - 1 if p[0] > 0 else p[0] + 1
        eng.add_request(f"prefill{i}", [first, *p[1:]], params)
    eng.step()
    _sync(device)
    before = eng.scheduler.num_computed_tokens_total
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = eng.scheduler.num_computed_tokens_total - before
    kernels, families, idle = [], {}, None
    if device != "cpu":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                eng.step()
            _sync(device)
        kernels, families = kernel_table(prof, 2)
        idle = gpu_idle(trace_events(prof), 2)
    host = host_side(eng.step, device) if device != "cpu" else None
    eng.abort(list(eng.requests))
    return {
        "steps": steps,
        "tokens_per_step": tokens / steps,
        "step_wall_ms": wall * 1000 / steps,
        "prefill_tok_s": tokens / wall,
        "gpu_ms_by_family": families,
        "kernels": kernels,
        "gpu_idle": idle,
        "host_side": host,
    }


def host_side(step, device: str, top: int = 25) -> dict:
    """One call of `step` seen from the host: the synchronizing CUDA calls it makes
    (torch's sync debug mode, each put down to the Python line that made it), the cyclic
    collector's pauses in it, and where its Python time goes (cProfile, by function, own
    time and with callees; the profiler slows Python, so read the shares, not the
    totals)."""
    import collections
    import cProfile
    import pstats
    import warnings

    import torch

    sites: collections.Counter = collections.Counter()
    prof = cProfile.Profile()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gc_pauses() as pauses:
                t0 = time.perf_counter()
                prof.enable()
                step()
                prof.disable()
                wall = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():
        rows.append((own, cum, calls, f"{Path(path).name}:{line}({name})"))
    by_own = sorted(rows, reverse=True)[:top]
    by_cum = sorted(rows, key=lambda r: r[1], reverse=True)[:top]
    return {
        "profiled_step_ms": wall * 1000,
        "sync_calls": sum(sites.values()),
        "sync_sites": dict(sites.most_common(top)),
        "gc_pauses": pauses,
        "python_own_ms": [f"{o * 1000:8.2f} {c:6d}x {n}" for o, _, c, n in by_own],
        "python_cum_ms": [f"{cu * 1000:8.2f} {c:6d}x {n}" for _, cu, c, n in by_cum],
    }


# kernel name fragments by family, first match wins (lower case)
FAMILIES = (
    (
        "attention",
        ("decode_split", "decode_merge", "mla_split", "mla_merge", "prefill_kernel", "store_kv"),
    ),
    ("linear_attention", ("kda", "chunk_", "recurrent", "delta_rule", "conv1d")),  # fla-core
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
    ("norm_rope_act", ("rms_norm", "qk_norm_rope", "silu")),
    ("sampling", ("argmax", "softmax", "exponential", "topk", "sort", "reduce_kernel")),
    ("copies", ("memcpy", "memset", "copy", "gather", "scatter")),
)


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_idle(events: list[dict], steps: int, min_gap_us: float = 2.0, top: int = 12) -> dict:
    """Where the GPU waits, from a torch profiler's Chrome trace events (CPU and CUDA
    activities): the time between GPU activities (kernels, copies, memsets, any stream,
    overlaps merged) over the window from the first to the last, per step, and each gap
    of at least min_gap_us put down to its causes:

    - the work that ends the gap was launched after the GPU went idle (its CUDA runtime
      call ended after the gap opened): the host was late. The gap up to the launch call
      goes to what the host was doing meanwhile, "host: <range>" by the innermost
      `record_function` range (batchgen.next_decode, .update, ...) at each moment, "host:
      (none)" outside every range; the rest, the launch call and its latency, to "launch:
      <range>" of the range the call was made in;
    - it had been launched before the gap opened: "device", the GPU waited on something
      else (an event of another stream, a synchronous copy).

    Returns {"gpu_busy_ms", "gpu_idle_ms", "idle_by_cause" (ms, largest first),
    "small_gaps_ms" (the idle time in gaps under min_gap_us, left unattributed: mostly
    between kernels already queued, as a graph's are), "host_ms" (time in each `record_function` range) and
    "runtime_ms" (in each CUDA runtime/driver call), "streams" (per stream: GPU
    activities and their ms), all per step, "gaps" (how many were put down to a
    cause), "idle_before_ms" (per step, the `top` activities whose start ended the most
    idle time) and "largest_gaps" (the `top` longest: microseconds, when from the first
    activity, the activity before and the one after)}."""
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
        key=lambda e: e["ts"],
    )
    launches = {}  # correlation id -> (start, end) of its CUDA runtime call
    ranges = []  # host record_function ranges: (start, end, name)
    host: dict[str, float] = {}
    runtime: dict[str, float] = {}
    streams: dict[str, list[float]] = {}  # stream -> [activities, us]
    for e in gpu:
        tally = streams.setdefault(str(e.get("args", {}).get("stream", "?")), [0, 0.0])
        tally[0] += 1
        tally[1] += e.get("dur", 0)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]] = runtime.get(e["name"], 0.0) + e.get("dur", 0)
            if "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = (e["ts"], e["ts"] + e.get("dur", 0))
        elif e.get("cat") == "user_annotation":
            ranges.append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
            host[e["name"]] = host.get(e["name"], 0.0) + e.get("dur", 0)
    busy = idle = small = 0.0
    causes: dict[str, float] = {}
    before_kernel: dict[str, float] = {}  # idle us by the activity that ended the gap
    largest: list[tuple[float, float, str, str]] = []  # (us, at, after, before)
    gaps = 0
    if gpu:
        start, end = gpu[0]["ts"], gpu[0]["ts"] + gpu[0].get("dur", 0)
        last = gpu[0]  # the activity whose end closes the running interval
        for e in gpu[1:]:
            e_start, e_end = e["ts"], e["ts"] + e.get("dur", 0)
            if e_start <= end:  # overlaps (or touches) the running interval
                if e_end > end:
                    end, last = e_end, e
                continue
            busy += end - start
            idle += e_start - end
            if e_start - end >= min_gap_us:
                gaps += 1
                for cause, us in _gap_causes(e, end, launches, ranges).items():
                    causes[cause] = causes.get(cause, 0.0) + us
                name = _short(e["name"])
                before_kernel[name] = before_kernel.get(name, 0.0) + e_start - end
                largest.append((e_start - end, end - gpu[0]["ts"], _short(last["name"]), name))
            else:
                small += e_start - end
            start, end, last = e_start, e_end, e
        busy += end - start
    per_step = max(steps, 1) * 1000.0

    def per_step_ms(totals: dict[str, float]) -> dict[str, float]:
        ordered = sorted(totals.items(), key=lambda kv: -kv[1])
        return {k: round(v / per_step, 4) for k, v in ordered}

    return {
        "gpu_busy_ms": busy / per_step,
        "gpu_idle_ms": idle / per_step,
        "idle_by_cause": per_step_ms(causes),
        "small_gaps_ms": small / per_step,
        "host_ms": per_step_ms(host),
        "runtime_ms": per_step_ms(runtime),
        "streams": {
            k: {"activities": n / max(steps, 1), "ms": us / per_step}
            for k, (n, us) in sorted(streams.items(), key=lambda kv: -kv[1][1])
        },
        "gaps": gaps,
        "idle_before_ms": dict(list(per_step_ms(before_kernel).items())[:top]),
        "largest_gaps": [
            f"{us:8.1f} us at {at / 1000:9.3f} ms: {after} -> {before}"
            for us, at, after, before in sorted(largest, reverse=True)[:top]
        ],
    }


def _short(name: str, width: int = 60) -> str:
    """A kernel's name cut to `width` characters (templated names run to thousands)."""
    return name if len(name) <= width else name[: width - 3] + "..."


def _gap_causes(after: dict, gap_start: float, launches: dict, ranges: list) -> dict:
    """The gap before GPU activity `after`, in microseconds by cause (see gpu_idle)."""
    gap_end = after["ts"]
    launch = launches.get(after.get("args", {}).get("correlation"))
    if launch is None or launch[1] <= gap_start:
        return {"device": gap_end - gap_start}
    called = min(max(launch[0], gap_start), gap_end)
    out: dict[str, float] = {}
    points = sorted(
        {gap_start, called} | {t for r in ranges for t in r[:2] if gap_start < t < called}
    )
    for a, b in zip(points, points[1:]):
        name = "host: " + _innermost(ranges, (a + b) / 2)
        out[name] = out.get(name, 0.0) + b - a
    if gap_end > called:
        name = "launch: " + _innermost(ranges, launch[0])
        out[name] = out.get(name, 0.0) + gap_end - called
    return out


def _innermost(ranges: list, at: float) -> str:
    inner = None
    for r_start, r_end, name in ranges:
        if r_start <= at <= r_end and (inner is None or r_end - r_start < inner[1] - inner[0]):
            inner = (r_start, r_end, name)
    return inner[2] if inner else "(none)"


def kernel_families(rows: list[tuple[str, float]]) -> dict[str, float]:
    """(kernel name, ms per step) rows summed by family; unmatched names go to other."""
    out = {name: 0.0 for name, _ in FAMILIES} | {"other": 0.0}
    for kernel, ms in rows:
        low = kernel.lower()
        fam = next((f for f, parts in FAMILIES if any(p in low for p in parts)), "other")
        out[fam] += ms
    return out


def _synced(fn, phase, acc, device):
    """fn wrapped so its host time and the GPU work it queued count toward `phase`."""

    def call(*a, **kw):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync(device)
        acc[phase] = acc.get(phase, 0.0) + time.perf_counter() - t0
        return out

    return call


def run_peer(ckpt, prompts, out_lens, args):
    """transformers' continuous batching with paged|sdpa, per-request max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).to(args.device)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(out_lens), eos_token_id=None, pad_token_id=0
    )
    mgr = model.init_continuous_batching(generation_config=gen)
    mgr.start()
    _sync(args.device)
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    got = 0
    for _ in prompts:
        res = mgr.get_result(timeout=600)
        if res is None:
            break
        got += len(res.generated_tokens)
    wall = time.perf_counter() - start
    mgr.stop()
    return {"wall_s": wall, "output_tokens": got, "tok_s": got / wall}


def _sync(device):
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def plot(timeline, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ts = [row[0] for row in timeline]
    rate = [
        (timeline[i][1] - timeline[i - 1][1]) / max(ts[i] - ts[i - 1], 1e-9)
        for i in range(1, len(timeline))
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(ts[1:], rate, lw=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens / s")
    ax.set_title("batchgen W1 throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and workload on the CPU")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--sampling",
        choices=sorted(SAMPLING) + ["all"],
        default=None,
        help="batchgen greedy, then sampled as named (all: every one), ratios to greedy",
    )
    add_engine_args(ap)
    args = ap.parse_args(argv)
    if args.small:
        cfg, (prompts, out_lens) = SMALL_MODEL, small_requests()
        args.device, args.dtype = "cpu", "float32"
        args.ckpt = args.ckpt.with_name(args.ckpt.name + "-small")
    else:
        cfg, (prompts, out_lens) = QWEN3_0_6B, w1_requests()
        args.device, args.dtype = "cuda", "bfloat16"
    ckpt = random_checkpoint(args.ckpt, cfg)
    if args.sampling:
        runs = run_sampling(ckpt, prompts, out_lens, args)
        args.out.mkdir(parents=True, exist_ok=True)
        workload = "small" if args.small else "W1"
        result = {"workload": workload, "sampling": runs}
        (args.out / "sampling.json").write_text(json.dumps(result, indent=2))
        for name, run in runs.items():
            sys.stdout.write(
                f"{name:<8} {run['tok_s']:10.1f} output tok/s  ({run['wall_s']:.2f} s)  "
                f"{run['ratio_to_greedy']:.2f}x greedy\n"
            )
        return 0
    ours, timeline = run_batchgen(ckpt, prompts, out_lens, args)
    peer = None if args.skip_peer else run_peer(ckpt, prompts, out_lens, args)
    roof = roofline_seconds(cfg, [len(p) for p in prompts], out_lens)
    result = {
        "workload": "small" if args.small else "W1",
        "batchgen": ours,
        "peer": peer,
        "roofline_s": roof,
        "roofline_tok_s": sum(out_lens) / roof,
        "fraction_of_roofline": roof / ours["wall_s"],
    }
    if peer:
        result["ratio"] = ours["tok_s"] / peer["tok_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(result, indent=2))
    plot(timeline, args.out / "throughput.png")
    lines = [
        f"batchgen    {ours['tok_s']:10.1f} output tok/s  ({ours['wall_s']:.2f} s, "
        f"{ours['backend']} attention)",
        f"roofline    {result['roofline_tok_s']:10.1f} output tok/s  -> batchgen at "
        f"{100 * result['fraction_of_roofline']:.1f}%",
    ]
    if peer:
        lines.append(
            f"transformers {peer['tok_s']:9.1f} output tok/s  ({peer['wall_s']:.2f} s)"
            f"  -> ratio {result['ratio']:.1f}x"
        )
    if args.profile:
        lines.append(json.dumps(ours["profile"], indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
