"""Where a step's time goes: decode and prefill steps profiled phase by phase, their
kernels by family, the GPU's idle gaps and the host's side (W1, W2, W4 and W6 use them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.card import sync
from benchmarks.engine_runs import gc_pauses


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
    from batchgen.engine.step_loop import Overlap

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
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(args.device)
    wall_ms = (time.perf_counter() - t0) * 1000 / steps

    phases: dict[str, float] = {}
    runner, sched = eng.runner, eng.scheduler
    overlap, eng.overlap = eng.overlap, Overlap()  # phases of plain steps
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
        setattr(obj, name, synced(fn, phase, phases, args.device))
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    synced_ms = (time.perf_counter() - t0) * 1000 / steps
    for obj, name, old in saved:
        if old is None:
            delattr(obj, name)
        else:
            setattr(obj, name, old)
    eng.overlap = overlap
    phase_ms = {k: v * 1000 / steps for k, v in phases.items()}
    phase_ms["rest"] = synced_ms - sum(phase_ms.values())

    kernels, families, idle = [], {}, None
    if args.device != "cpu":
        # pipelined steps: settle the queue on both sides, so the window holds whole steps
        eng._drain()
        sync(args.device)
        first = eng.stats.steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                eng.step()
            eng._drain()
            sync(args.device)
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
    sync(device)
    first = eng.stats.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        eng._drain()
        sync(device)
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


def fresh_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts with their first token one lower (one higher where it is 0), so that
    none of their pages is in the prefix cache a run of the prompts themselves left."""
    return [[p[0] - 1 if p[0] > 0 else p[0] + 1, *p[1:]] for p in prompts]


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
    for i, p in enumerate(fresh_prompts(prompts)):
        eng.add_request(f"prefill{i}", p, params)
    eng.step()
    sync(device)
    before = eng.scheduler.num_computed_tokens_total
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(device)
    wall = time.perf_counter() - t0
    tokens = eng.scheduler.num_computed_tokens_total - before
    kernels, families, idle = [], {}, None
    if device != "cpu":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                eng.step()
            sync(device)
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
    sync(device)
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
    ("norm_rope_act", ("rms_norm", "qk_norm_rope", "mla_rope", "silu")),
    (
        "sampling",
        ("argmax", "softmax", "exponential", "topk", "sort", "reduce_kernel")
        + ("_sample_kernel", "_mass_kernel", "_nucleus_kernel", "_penalty_kernel"),  # ours
    ),
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


def synced(fn, phase, acc, device):
    """fn wrapped so its host time and the GPU work it queued count toward `phase`."""

    def call(*a, **kw):
        sync(device)
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sync(device)
        acc[phase] = acc.get(phase, 0.0) + time.perf_counter() - t0
        return out

    return call
