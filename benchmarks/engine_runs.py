"""Timed batchgen runs, and the engine options every workload takes (add_engine_args,
engine_kwargs; the host tier's: add_policy_args, policy_kwargs).

For the host-tier workloads (pressure.py, shared_prefix.py), one engine per run: built,
warmed up on prompts that share no page with the workload, timed over the workload, its
counters taken for the timed part only, then freed (copy worker closed, del + gc +
torch.cuda.empty_cache()) so the next run in the same process starts from the same
device memory.
"""

from __future__ import annotations

import argparse
import gc
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from benchmarks.card import sync
from benchmarks.workloads import MODELS, config_dir

# counters that are rates: recomputed from the timed part's deltas, not subtracted
RATES = ("copy_gb_per_s", "host_prefix_hit_rate")
# metrics() keys that describe the engine rather than count its work (the tier's cost
# rule: tier_loads_pay, tier_load_us_per_token, ...; the weights' bytes and the device
# pool's pages): reported as they are
STATIC = ("tier_", "weight_bytes", "kv_pages")


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine and file options every benchmark script takes."""
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-pipeline", action="store_true", help="no pipelined decode")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="every step scheduled and launched while the one before runs (EngineConfig)",
    )
    ap.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: the engine's, for the device"
    )
    ap.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="default: the engine's, for the device",
    )
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/batchgen-w1-qwen3-0.6b"))
    ap.add_argument("--out", type=Path, default=Path("."))


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model (a workloads.MODELS name) with random weights, and --ckpt as the directory
    for its config.json and placeholder tokenizer (no weights: load_format="dummy")."""
    ap.add_argument(
        "--model",
        default="qwen3-0.6b",
        choices=sorted(MODELS),
        help="architecture, random bf16 weights (--small: a CPU-sized one of the same kind)",
    )
    ap.set_defaults(ckpt=None)


def dummy_model(args: argparse.Namespace) -> tuple[dict, Path]:
    """--model's config (--small: its CPU-sized version) and a directory with its
    config.json and placeholder tokenizer only: --ckpt, else /tmp/batchgen-<model>-config
    (+ "-small"). The engine draws the weights (load_format="dummy")."""
    full, small = MODELS[args.model]
    config = small if args.small else full
    path = args.ckpt or Path(f"/tmp/batchgen-{args.model}-config")
    if args.small:
        path = path.with_name(path.name + "-small")
    return config, config_dir(path, config)


def comma_list(text: str, allowed, usage: str) -> list[str]:
    """--runs-style option: the names in `text`, each once, in the order given;
    argparse.ArgumentTypeError with `usage` for an empty list or a name not in
    `allowed`."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names or set(names) - set(allowed):
        raise argparse.ArgumentTypeError(f"{usage}; got {text!r}")
    return names


def engine_default(name: str):
    """An EngineConfig field's default."""
    from batchgen.config import EngineConfig

    return EngineConfig.__dataclass_fields__[name].default


def add_policy_args(ap: argparse.ArgumentParser, admission: bool = True) -> None:
    """--tier-policy (and --admission), defaulting to the engine's defaults."""
    if admission:
        ap.add_argument(
            "--admission", default=engine_default("admission"), choices=("prefix", "arrival")
        )
    ap.add_argument(
        "--tier-policy",
        default=engine_default("tier_policy"),
        choices=("auto", "always"),
        help="when the host tier loads KV instead of recomputing it (tier-on runs)",
    )
    ap.add_argument(
        "--copy-issue",
        default=engine_default("tier_copy_issue"),
        choices=("worker", "inline"),
        help="which thread issues the host tier's CUDA copies (tier-on runs)",
    )
    ap.add_argument(
        "--load-scatter",
        default=engine_default("tier_load_scatter"),
        choices=("copy", "compute"),
        help="which stream scatters a load's staged pages into the pool (tier-on runs)",
    )


def policy_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the options of add_policy_args, for an engine whose
    weights are drawn from its config (load_format="dummy")."""
    kw = dict(
        tier_policy=args.tier_policy,
        tier_copy_issue=args.copy_issue,
        tier_load_scatter=args.load_scatter,
        load_format="dummy",
    )
    if hasattr(args, "admission"):
        kw["admission"] = args.admission
    return kw


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the options of add_engine_args."""
    return dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        attention_backend=args.backend,
        enforce_eager=args.eager,
        pipeline_decode=not args.no_pipeline,
        async_scheduling=args.async_scheduling,
    )


def timed_run(
    ckpt: Path,
    prompts: list[list[int]],
    out_lens: list[int],
    warmup_len: int,
    after=None,
    phases: bool = False,
    **engine_kw,
) -> dict:
    """Run every prompt greedily to exactly its output length (ignore_eos) on a fresh
    engine built with engine_kw, then free it; returns wall time, output tok/s, the timed
    part's counters (engine metrics() plus copy_seconds) and a per-step timeline.
    after(llm), if given, runs on the engine after the timed part (e.g. a profile); what
    it returns is the result's "after". phases: each step's host time in the engine
    calls step_phases names, too ("step_phases", one row a step)."""
    with built_engine(ckpt, **engine_kw) as llm:
        result = _timed(llm, prompts, out_lens, warmup_len, phases)
        if after is not None:
            result["after"] = after(llm)
        del llm  # built_engine's exit frees the engine only once no name here holds it
    return result


@contextmanager
def built_engine(ckpt: Path, **engine_kw):
    """An LLM built with engine_kw (under threads_for its device), freed on exit with
    its tier's copy threads and the device memory it cached: the caller deletes its own
    name for it inside the block (`del llm`), or the engine outlives the exit and the
    next engine built in the process finds its memory still taken."""
    import torch

    from batchgen import LLM

    with threads_for(engine_kw["device"]):
        llm = LLM(model=str(ckpt), **engine_kw)
        try:
            yield llm
        finally:
            if llm.engine.tier is not None:
                llm.engine.tier.copies.close()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


@contextmanager
def threads_for(device: str):
    """One torch thread for CPU runs: the --small models' matrices are tiny, so one thread
    is as fast, and it does not slow down 50x when another process holds the other cores
    (OpenMP spin waits). The previous count is restored."""
    import torch

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# (column, object path from the engine, method): the host calls step_phases times. update
# applies a step's tokens (finished requests release their pages and slots there). They
# nest: schedule holds the preemptions' swap_out and the step's flush (take_step_copies);
# flush_ahead (the stores ahead a pipelined step submits after its launch) is outside
# it; flush and flush_ahead hold the tier's store and load submits, which hold gather (a
# store's source pages read on the compute stream) and submit (CopyEngine.submit, the
# hand-off to the copy worker).
PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("swap_out", "kv", "swap_out"),
    ("flush", "tier", "flush"),
    ("flush_ahead", "tier", "flush_ahead"),
    ("poll", "tier", "poll"),
    ("launch", "runner", "launch_decode"),
    ("execute", "runner", "execute"),
    ("result", None, "InFlightDecode.result"),
    ("store", "tier", "_submit_store"),
    ("load", "tier", "_submit_load"),
    ("gather", "module", "batchgen.kv.copy_ledger.gather_pages"),
    ("submit", "tier.copies", "submit"),
    ("update", "scheduler", "update"),
)


def phase_table(rows: list[list[float]]) -> dict:
    """A run's "step_phases" entry: PHASES' columns and a row of host ms a step."""
    return {"columns": [name for name, _, _ in PHASES], "rows": rows}


def timed_into(
    spent: dict[str, float], name: str, fn, clock=time.perf_counter, open_calls: list | None = None
):
    """fn, adding the seconds each call takes to spent[name] (by `clock`). With
    `open_calls` (one list shared by the wrappers of a set of phases) a call's time
    excludes that of the calls so timed that it makes: nested phases count once, each in
    its own."""

    def wrapper(*a, **k):
        inner = [0.0]  # the nested timed calls' time
        if open_calls is not None:
            open_calls.append(inner)
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            took = clock() - t0
            if open_calls is not None:
                open_calls.pop()
                if open_calls:
                    open_calls[-1][0] += took
            spent[name] = spent.get(name, 0.0) + took - inner[0]

    return wrapper


@contextmanager
def step_phases(eng):
    """Milliseconds of host time spent in each of PHASES' calls since the last take():
    yields take(), which returns them as one row (PHASES' order) and starts again. The
    calls are wrapped on the engine's objects (InFlightDecode on its class, a module's
    function in its module) and given back on exit; a phase whose object the engine
    lacks (no tier) stays 0."""
    import importlib

    from batchgen.runner.model_runner import InFlightDecode

    spent = dict.fromkeys((name for name, _, _ in PHASES), 0.0)
    undo = []

    def restore(owner, attr, original, own):
        # an attribute the object held itself is put back; one it found on its class
        # (a method) is dropped again
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)

    for name, path, method in PHASES:
        if path is None:
            owner, attr = InFlightDecode, "result"
        elif path == "module":
            module, attr = method.rsplit(".", 1)
            owner = importlib.import_module(module)
        else:
            owner, attr = eng, method
            for part in path.split("."):
                owner = getattr(owner, part, None)
            if owner is None:
                continue
        original = getattr(owner, attr)
        own = attr in vars(owner)
        setattr(owner, attr, timed_into(spent, name, original))
        undo.append(lambda o=owner, a=attr, f=original, w=own: restore(o, a, f, w))

    def take() -> list[float]:
        row = [round(spent[name] * 1e3, 3) for name, _, _ in PHASES]
        for name in spent:
            spent[name] = 0.0
        return row

    try:
        yield take
    finally:
        for put_back in reversed(undo):
            put_back()


def _timed(
    llm, prompts: list[list[int]], out_lens: list[int], warmup_len: int, phases: bool = False
) -> dict:
    from batchgen import SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    warmup = [[2 + i] * warmup_len for i in range(4)]
    llm.generate(warmup, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    eng = llm.engine
    before = counters(eng)
    sync(eng.device)
    alloc_before = allocator_stats(eng.device)
    with fewer_full_collections():  # as LLM.generate runs
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            eng.add_request(
                f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            )
        added_s = time.perf_counter() - start  # the timeline's first step includes this
        lengths: dict[str, int] = {}
        # per step: seconds, output tokens so far, tokens computed so far, running requests,
        # tier pages copied so far (offloaded + loaded; 0 without the tier): a step whose
        # count grew submitted copies, which its forward may wait on
        tier = eng.tier.metrics if eng.tier is not None else None

        def copied() -> int:
            return tier.pages_offloaded + tier.pages_loaded if tier is not None else 0

        copied_before = copied()  # the warm-up's copies left out
        timeline = []
        # every 100 steps: the allocator's segments and cudaMalloc calls so far, to see
        # whether what it holds grows with the run (sampled: memory_stats is not free)
        alloc_trace = []
        phase_rows = []
        phase_timer = step_phases(eng) if phases else nullcontext(None)
        with phase_timer as take_phases:
            while eng.has_unfinished:
                if len(timeline) % 100 == 0 and alloc_before is not None:
                    now = allocator_stats(eng.device, alloc_before)
                    alloc_trace.append([len(timeline), now["segments"], now["device_mallocs"]])
                for req in eng.step():
                    lengths[req.request_id] = len(req.output_token_ids)
                timeline.append(
                    [
                        round(time.perf_counter() - start, 4),
                        eng.stats.output_tokens - before["output_tokens"],
                        eng.scheduler.num_computed_tokens_total - before["computed_tokens"],
                        len(eng.scheduler.running),
                        copied() - copied_before,
                    ]
                )
                if take_phases is not None:
                    phase_rows.append(take_phases())
    sync(eng.device)
    wall = time.perf_counter() - start
    alloc = allocator_stats(eng.device, alloc_before)
    out = sum(lengths.values())
    return {
        "wall_s": wall,
        "output_tokens": out,
        "tok_s": out / wall,
        "all_outputs": all(lengths.get(f"r{i}") == n for i, n in enumerate(out_lens)),
        "backend": eng.runner.attention_backend,
        "cuda_graphs": eng.runner.graphs is not None,
        # asked for and used: the engine may decline it
        "async_scheduling": eng.overlap.name == "async",
        "metrics": delta(before, counters(eng), len(prompts)),
        "add_requests_s": added_s,
        "timeline": timeline,
        "allocator": alloc,
        "allocator_trace": alloc_trace,
        # with phases: a row a step, ms of host time in each of PHASES' calls
        "step_phases": phase_table(phase_rows) if phases else None,
    }


def allocator_stats(device, before: dict | None = None) -> dict | None:
    """The CUDA caching allocator's counters (cudaMalloc and cudaFree calls, retries after
    a failed allocation: each frees the cache and synchronises) as counted since `before`,
    and its segments and peak reserved memory now; None on the CPU."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    s = torch.cuda.memory_stats(device)
    counts = {
        "device_mallocs": s.get("num_device_alloc", 0),
        "device_frees": s.get("num_device_free", 0),
        "alloc_retries": s.get("num_alloc_retries", 0),
    }
    if before is not None:
        counts = {k: v - before[k] for k, v in counts.items()}
    counts["segments"] = s.get("segment.all.current", 0)
    counts["reserved_peak_bytes"] = s.get("reserved_bytes.all.peak", 0)
    return counts


def counters(eng) -> dict:
    """The engine's metrics() with the tier's copy time and host lookups beside them."""
    m = {k: v for k, v in eng.metrics().items() if k not in RATES}
    m["page_size"] = eng.config.page_size
    if eng.tier is not None:
        m["copy_seconds"] = eng.tier.metrics.copy_seconds
        m["host_prefix_query_pages"] = eng.tier.metrics.host_prefix_query_pages
    return m


def delta(before: dict, after: dict, num_requests: int) -> dict:
    """Counters of the timed part, rates recomputed from them, and the prefill tokens
    computed: every computed token except the one decode token per output after a
    request's first (so a recompute's re-prefill counts as prefill)."""
    out = {
        k: v if k.startswith(STATIC) else v - before.get(k, 0)
        for k, v in after.items()
        if k != "page_size"
    }
    out["prefill_tokens_computed"] = out["computed_tokens"] - (out["output_tokens"] - num_requests)
    if "copy_seconds" in out:
        moved = out["bytes_offloaded"] + out["bytes_loaded"]
        secs = out["copy_seconds"]
        out["copy_gb_per_s"] = moved / secs / 1e9 if secs > 0 else 0.0
        q = out["host_prefix_query_pages"]
        out["host_prefix_hit_rate"] = out["host_prefix_hit_pages"] / q if q else 0.0
        out["host_prefix_hit_tokens"] = out["host_prefix_hit_pages"] * after["page_size"]
    return out


def cost_rule(metrics: dict) -> str:
    """The tier's cost-rule verdict in words ("" for a run without a tier)."""
    if "tier_loads_pay" not in metrics:
        return ""
    verdict = "loads" if metrics["tier_loads_pay"] else "idle (recomputes)"
    return (
        f"cost rule: load {metrics.get('tier_load_us_per_token', 0.0):.3g} us/token vs "
        f"recompute {metrics.get('tier_recompute_us_per_token', 0.0):.3g} us/token -> tier "
        f"{verdict}"
    )


def checks_line(checks: dict[str, bool]) -> str:
    return "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items())


def size(nbytes: int) -> str:
    """A byte count for a summary line, in GiB or MiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


@contextmanager
def compile_log(step_of):
    """Triton kernel specialisations first met inside the block (compiled, or read from
    Triton's disk cache: either way not met in the warm-up), as "step N: repr" with N
    from `step_of()`, through Triton's jit_cache_hook; nothing is logged without
    Triton."""
    entries: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        yield entries
        return
    before = knobs.runtime.jit_cache_hook

    def hook(*, repr, **kwargs):
        entries.append(f"step {step_of()}: {repr[:300]}")
        return before(repr=repr, **kwargs) if before is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield entries
    finally:
        knobs.runtime.jit_cache_hook = before


@contextmanager
def gc_pauses():
    """The cyclic collector's pauses inside the block, through gc.callbacks: per
    generation the number of collections and their milliseconds (a collection runs on
    whichever thread allocates, so a pause lands in a step's host time as idle GPU time
    between launches)."""
    out: dict[str, dict[str, float]] = {}
    started: list[float] = []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            entry = out.setdefault(f"gen{info['generation']}", {"collections": 0, "ms": 0.0})
            entry["collections"] += 1
            entry["ms"] = round(entry["ms"] + (time.perf_counter() - started.pop()) * 1000, 3)

    gc.callbacks.append(callback)
    try:
        yield out
    finally:
        gc.callbacks.remove(callback)
