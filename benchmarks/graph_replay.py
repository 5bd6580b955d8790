"""How fast each captured decode graph replays, captured once and then again.

On the GPU (from the repository root):

    PYTHONPATH=src python3 benchmarks/graph_replay.py --model llama-3.1-8b --out $OUT

W2-8B's decode steps ran ~0.15 ms slower in the tier-on run than in the tier-off one,
with the same kernels: the replayed graph's kernels started later after one another. A
tier-off engine whose graphs were captured again after its run showed the same gaps. So
this script builds one engine (tier off unless --host-gib, W2-8B's pool), lets its first
decode capture the graphs, then captures them again --captures times, and after each
capture times the replay of the --buckets graphs alone (CUDA events around --replays
back-to-back replays, the median of five such batches) at a context of --context tokens
a row, on the engine's stream and (--side, in brackets) on a stream of torch's pool.
Each capture's stream (torch's pool hands them out in turn) is recorded beside it.
`--same-stream` captures every time on one stream instead of a new one; `--empty-cache`
releases the allocator's cache before each capture again; `--keep-first` keeps the
engine's graphs and times them again at the end; `--probes` does one thing at a time
after the captures and times the graphs after each (see --probes: work on a new
stream, on the capture stream, pinned memory, a device segment, copies, events, a
kernel no step had run (its module loaded then), and, with --host-gib and a small
--kv-gib, a generate that swaps through the host tier).

Found with it (H200, torch 2.11): the engine's graphs replay ~0.17 ms slower at 32 rows
(430 kernels) once work has run on a further stream of the process, and stay so; the
graphs themselves are not the cause (the first capture's graphs, kept, slow down as
much). A second further stream adds nothing. Work on the capture stream itself (replays,
a kernel from another thread, 64 MiB copies either way, a timed event the default
stream waits on) changes nothing, nor does pinning a 64 GiB tier; a generate that swaps
through the tier slows the replays as much, with GPU work on two streams only.

Writes graph_replay.json into --out and prints one line per capture or probe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_runs import add_model_args, built_engine, dummy_model  # noqa: E402


def stage_rows(graphs, bs: int, context: int, page_size: int, num_pages: int) -> None:
    """The static inputs of a bs-row decode at `context` tokens a row, each row its own
    pages, writing no KV (slot -1): every capture replays the same step."""
    import torch

    pages = -(-context // page_size)
    graphs.input_ids[:bs].zero_()
    graphs.positions[:bs].fill_(context - 1)
    graphs.slots[:bs].fill_(-1)
    graphs.seq_lens[:bs].fill_(context)
    rows = torch.arange(bs, device=graphs.table.device).unsqueeze(1) * pages
    cols = torch.arange(pages, device=graphs.table.device).unsqueeze(0)
    graphs.table[:bs, :pages] = (rows + cols) % num_pages


def replay_ms(graph, replays: int) -> float:
    import torch

    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / replays)
    return statistics.median(times)


PROBES = (
    *("capture", "d2h", "event", "h2d", "kernel", "malloc", "none", "pin", "stream", "swap"),
    *("swap-traced", "thread", "pinmem", "gates", "alloc", "index", "store", "load"),
    *("index-only", "index-put", "index-default", "index-alloc", "arange", "stream-copy"),
    *("load-alloc", "load-triton"),
)
# the probes on_capture_stream does
CAPTURE_STREAM_PROBES = (
    *("d2h", "event", "h2d", "thread", "pinmem", "gates", "alloc", "index", "store", "load"),
    *("index-only", "index-put", "index-alloc", "arange", "load-alloc", "load-triton"),
)


def parse_probes(text: str) -> list[str]:
    """--probes: names in order, repeats kept (each `stream` is one more stream)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown probes {unknown}; known: {', '.join(PROBES)}")
    return names


class ClockSampler:
    """The GPU's clocks while replays run, read through NVML (nvidia-ml-py) every few
    ms by a thread: SM and memory MHz (medians), board power (W, median) and the clock
    event reasons seen (NVML's bit mask, or-ed). Empty where NVML is not there."""

    def __init__(self, period_s: float = 0.005):
        import threading

        self.period_s, self.samples, self.reasons = period_s, [], 0
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._dev = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML here: clocks not read
            self._nvml = None

    def _run(self) -> None:
        nv = self._nvml
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        while not self._stop.is_set():
            sm = nv.nvmlDeviceGetClockInfo(self._dev, nv.NVML_CLOCK_SM)
            mem = nv.nvmlDeviceGetClockInfo(self._dev, nv.NVML_CLOCK_MEM)
            watts = nv.nvmlDeviceGetPowerUsage(self._dev) / 1000
            self.samples.append((sm, mem, watts))
            self.reasons |= reasons(self._dev)
            self._stop.wait(self.period_s)

    def __enter__(self):
        import threading

        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        sm, mem, watts = (statistics.median(col) for col in zip(*self.samples))
        low = min(s[0] for s in self.samples)
        return {"sm_mhz": sm, "sm_mhz_min": low, "mem_mhz": mem, "watts": round(watts, 1),
                "reasons": hex(self.reasons), "samples": len(self.samples)}  # fmt: skip


def time_graphs(graphs, table: dict, buckets, args, geometry, side_stream=None):
    """Replay ms of each of `buckets` in `table` (bucket -> graph), on the current stream
    and, with side_stream, on that one too; the static inputs staged for each. The
    clocks seen while they ran go into `table`'s bucket "clocks" of the returned side
    dict (ClockSampler)."""

    times, side = {}, {}
    sampler = ClockSampler()
    with sampler:
        _time_buckets(graphs, table, buckets, args, geometry, side_stream, times, side)
    if sampler.samples:
        side["clocks"] = sampler.summary()
    return times, side


def _time_buckets(graphs, table, buckets, args, geometry, side_stream, times, side) -> None:
    import torch

    for bs in buckets:
        if bs not in table:
            continue
        stage_rows(graphs, bs, args.context, *geometry)
        times[bs] = replay_ms(table[bs], args.replays)
        if side_stream is not None:
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                side[bs] = replay_ms(table[bs], args.replays)
            torch.cuda.current_stream().wait_stream(side_stream)


def report(label: str, times: dict, side: dict) -> None:
    cells = ", ".join(
        f"bs {bs}: {ms:.3f}" + (f" ({side[bs]:.3f})" if bs in side else "")
        for bs, ms in times.items()
    )
    clocks = f" {side['clocks']}" if "clocks" in side else ""
    sys.stdout.write(f"{label}: {cells} ms{clocks}\n")
    sys.stdout.flush()


def index_tensors() -> list:
    """The index probes' tensors, made on the current stream: a pool-like tensor, a
    staging of 16 pages, and the index of the pages it scatters to."""
    import torch

    pool = torch.zeros(4, 256, 4096, dtype=torch.bfloat16, device="cuda")
    staging = torch.ones(4, 16, 4096, dtype=torch.bfloat16, device="cuda")
    return [pool, staging, torch.arange(16, device="cuda") * 3]


def index_scatter() -> list:
    """The index probe on the current stream: its tensors made, then the scatter."""
    pool, staging, idx = tensors = index_tensors()
    pool.index_copy_(1, idx, staging)
    return tensors


def on_capture_stream(probe: str, stream, tier=None):
    """What the host tier does on its copy stream, one thing at a time, on the engine's
    capture stream: a timed event the default stream waits on (event), a 64 MiB copy
    from pinned host memory (h2d) or into it (d2h), a kernel issued by another thread
    (thread), a small index uploaded through pinned memory (pinmem), a new segment
    (alloc), a scatter into a pool-like tensor (index; index-only: its tensors made
    before, on the default stream; index-put: that scatter as an indexed assignment;
    index-alloc: its tensors made here, no scatter; arange: only its index made), a gate
    event a layer (gates), or the tier's own page copy functions on 64 pages of its
    pools, device to host (store) or back (load; needs --host-gib; its staging and index
    made on the default stream first, as the tier makes them; load-alloc: made on this
    stream, as the tier made them before; load-triton: as load, scattered by
    kernels/page_scatter.py instead of index_copy_). Returns what must stay alive."""
    import threading

    import torch

    from batchgen.kv.pinned import host_empty

    kept = []
    if probe in ("index-only", "index-put"):  # tensors made on the default stream first
        kept += index_tensors()
        pool, staging, idx = kept
    if probe in ("store", "load", "load-alloc", "load-triton") and tier is None:
        raise SystemExit(f"--probes {probe} needs the host tier (--host-gib)")
    pages = list(range(64))
    buffers = None
    if probe in ("load", "load-triton"):  # the tier's load buffers: on the default stream
        from batchgen.kv.page_copies import load_buffers

        buffers = load_buffers(tier.host_pool.kv, tier.device_pool.kv, pages, pages)
    stream.wait_stream(torch.cuda.current_stream())
    if probe == "thread":

        def work():
            with torch.cuda.stream(stream):
                kept.append(torch.ones(1 << 20, device="cuda") * 2)

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    with torch.cuda.stream(stream):
        if probe == "event":
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            done.record(stream)
            torch.cuda.default_stream().wait_event(done)
            kept += [start, done]
        elif probe in ("h2d", "d2h"):
            host = host_empty((64 << 20,), torch.uint8, pin=True)
            dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            if probe == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            kept += [host, dev]
        elif probe == "pinmem":  # forward_context.to_device, as a load's index goes up
            from batchgen.forward_context import to_device

            kept += [to_device(torch.arange(64 + i), torch.device("cuda")) for i in range(8)]
        elif probe == "alloc":  # a segment of a size nothing asked for, on this stream
            kept.append(torch.empty(37 << 20, dtype=torch.uint8, device="cuda").fill_(1))
        elif probe == "index":  # a load's scatter into a pool-like tensor
            kept += index_scatter()
        elif probe == "index-only":
            pool.index_copy_(1, idx, staging)
        elif probe == "index-alloc":  # the index probe's tensors made here, no scatter
            kept += index_tensors()
        elif probe == "index-put":  # the same scatter as an indexed assignment
            pool[:, idx] = staging
        elif probe == "arange":  # the index probe's index, made on this stream
            kept.append(torch.arange(16, device="cuda") * 3)
        elif probe in ("store", "load", "load-alloc", "load-triton"):
            from batchgen.kv.page_copies import device_to_host_pages, host_to_device_pages

            dev_kv, host_kv = tier.device_pool.kv, tier.host_pool.kv
            if probe == "store":
                kept.append(device_to_host_pages(dev_kv, host_kv, pages, pages))
            else:
                host_kv[:, :64].zero_()  # host pages a store never wrote: no NaNs loaded
                scatter = "triton" if probe == "load-triton" else "index"
                kept.append(
                    host_to_device_pages(
                        host_kv, dev_kv, pages, pages, buffers=buffers, scatter=scatter
                    )
                )
        elif probe == "gates":  # a gate event a layer, each waited on by the default stream
            host = host_empty((32, 1 << 20), torch.uint8, pin=True)
            dev = torch.empty(32, 1 << 20, dtype=torch.uint8, device="cuda")
            for layer in range(32):
                dev[layer].copy_(host[layer], non_blocking=True)
                gate = torch.cuda.Event()
                gate.record(stream)
                torch.cuda.default_stream().wait_event(gate)
                kept.append(gate)
            kept += [host, dev]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return kept


def swap_run(llm, traced: bool) -> dict:
    """A generate that preempts and swaps through the tier (run with a small --kv-gib and
    --host-gib), as W2 does; with `traced`, under the profiler, with the GPU activities
    it ran counted by stream and kind."""
    from collections import Counter

    import torch
    from throughput import GPU_CATEGORIES, trace_events

    from batchgen import SamplingParams

    prompts = [[(7 * i + j) % 30000 + 10 for j in range(512)] for i in range(24)]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    before = llm.engine.metrics()
    if traced:
        activity = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activity) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        events = trace_events(prof)
    else:
        llm.generate(prompts, params, use_tqdm=False)
    after = llm.engine.metrics()
    out = {k: after[k] - before[k] for k in ("swaps_out", "swaps_in", "pages_loaded")}
    if traced:
        tally = Counter(
            f"stream {e.get('args', {}).get('stream', '?')} {e['cat']}"
            for e in events
            if e.get("cat") in GPU_CATEGORIES
        )
        out["gpu_activities"] = dict(sorted(tally.items()))
    return out


def each_in_its_process(args) -> int:
    """--each: every probe in a child process of this script, timed by the `none` probe
    just before it and the one just after."""
    import subprocess

    common = ["--model", args.model, "--buckets", args.buckets, "--context", str(args.context)]
    common += ["--replays", str(args.replays), "--kv-gib", str(args.kv_gib)]
    common += ["--host-gib", str(args.host_gib), "--captures", "0"]
    table = {}
    for probe in args.probes:
        out = args.out / f"each-{probe}"
        cmd = [sys.executable, __file__, *common, "--probes", f"none,{probe},none"]
        done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"probe {probe} failed:\n{done.stderr[-4000:]}")
        rows = [r for r in json.loads((out / "graph_replay.json").read_text()) if "replay_ms" in r]
        before, after = rows[1]["replay_ms"], rows[-1]["replay_ms"]
        table[probe] = {bs: after[bs] - before[bs] for bs in before}
        cells = ", ".join(f"bs {bs}: {before[bs]:.3f} -> {after[bs]:.3f}" for bs in before)
        cells += " ms"
        clocks = [rows[1].get("clocks"), rows[-1].get("clocks")]
        if all(clocks):
            table[probe]["clocks"] = clocks
            cells += "; " + " -> ".join(
                f"SM {c['sm_mhz']:.0f} (min {c['sm_mhz_min']}) MHz, mem {c['mem_mhz']:.0f}, "
                f"{c['watts']} W, reasons {c['reasons']}"
                for c in clocks
            )
        sys.stdout.write(f"{probe:>12}: {cells}\n")
        sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_replay_each.json").write_text(json.dumps(table, indent=2))
    return 0


def main(argv=None) -> int:
    import torch

    from batchgen import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--buckets", default="8,32,64,128,256")
    ap.add_argument("--context", type=int, default=1337)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--captures", type=int, default=4)
    ap.add_argument("--same-stream", action="store_true")
    ap.add_argument(
        "--side",
        action="store_true",
        help="time each replay on a stream of torch's pool too (that stream then has work)",
    )
    ap.add_argument(
        "--empty-cache",
        action="store_true",
        help="release the allocator's cached memory (the old graphs' pool among it) before "
        "each capture again",
    )
    ap.add_argument("--host-gib", type=float, default=0.0, help="host tier (0: off)")
    ap.add_argument(
        "--keep-first",
        action="store_true",
        help="keep the engine's graphs alive through the captures again and time them once "
        "more at the end: whether a later capture slows the graphs already there",
    )
    ap.add_argument(
        "--probes",
        type=parse_probes,
        default=[],
        help="comma list, each done after the captures and followed by the engine graphs' "
        "times: malloc (a new 2 GiB device segment), pin (1 GiB of host memory pinned as "
        "the tier pins), stream (work on a new stream of torch's pool), none (nothing: "
        "the times again), capture (the replays timed on the engine's first capture "
        "stream instead, so that stream gets work and no new one does), kernel (a "
        "float64 cumprod, never run before, on the default stream), stream-copy (a 64 "
        "MiB copy from pinned memory on a new stream, no kernel), index-default (the "
        "index probe on the default stream), swap and "
        "swap-traced (a generate that swaps through the tier; see swap_run), and "
        "the work on the capture stream that on_capture_stream describes: "
        + ", ".join(CAPTURE_STREAM_PROBES),
    )
    ap.add_argument(
        "--each",
        action="store_true",
        help="each of --probes in a fresh process of its own (none, the probe, none, with "
        "--captures 0), then one line a probe: what it changed. A probe's effect lasts "
        "for the rest of its process, so a sequence in one process tells only the first",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_replay.py times CUDA graphs: it needs a GPU")
    if args.each:
        return each_in_its_process(args)
    args.small = False
    _, ckpt = dummy_model(args)
    buckets = [int(b) for b in args.buckets.split(",")]
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=2048 + 512,
        kv_cache_size_gib=args.kv_gib,
        host_kv_size_gib=args.host_gib,
    )
    rows = []
    with built_engine(ckpt, **kw) as llm:
        eng = llm.engine
        warm = [[2 + i] * 64 for i in range(4)]
        llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        make_stream = torch.cuda.Stream
        graphs = eng.runner.graphs
        geometry = (eng.config.page_size, eng.kv.allocator.num_pages)
        side_stream = make_stream() if args.side else None  # replays timed there too
        first_stream = None

        def capture_stream(*a, **k):
            nonlocal first_stream
            if first_stream is None or not args.same_stream:
                s = make_stream(*a, **k)
                first_stream = first_stream or s
            else:
                s = first_stream
            streams.append(s.stream_id)
            return s

        first_graphs = {}
        for i in range(args.captures + 1):
            streams: list[int] = []
            if i > 0:
                torch.cuda.synchronize()
                if i == 1 and args.keep_first:
                    first_graphs = dict(graphs.graphs)
                graphs.graphs.clear()
                if args.empty_cache:
                    torch.cuda.empty_cache()
                torch.cuda.Stream = capture_stream
                try:
                    graphs.capture()
                finally:
                    torch.cuda.Stream = make_stream
            times, side = time_graphs(graphs, graphs.graphs, buckets, args, geometry, side_stream)
            rows.append(
                {"capture": i, "streams": streams, "replay_ms": times, "side_stream_ms": side}
            )
            report(f"capture {i} ({'engine' if i == 0 else f'stream ids {streams}'})", times, side)
        if first_graphs:
            times, _ = time_graphs(graphs, first_graphs, buckets, args, geometry)
            rows.append({"capture": 0, "again": True, "replay_ms": times})
            report("capture 0 (engine), timed again at the end", times, {})
        held = []
        for probe in args.probes:
            if probe == "malloc":
                held.append(torch.empty(2 << 30, dtype=torch.uint8, device="cuda"))
            elif probe == "pin":
                from batchgen.kv.pinned import host_empty

                held.append(host_empty((1 << 30,), torch.uint8, pin=True))
            elif probe == "stream":
                with torch.cuda.stream(make_stream()):
                    held.append(torch.ones(1 << 20, device="cuda") * 2)
                torch.cuda.synchronize()
            elif probe == "stream-copy":  # a new stream that only copies (no kernel)
                from batchgen.kv.pinned import host_empty

                host = host_empty((64 << 20,), torch.uint8, pin=True)
                dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
                copier = make_stream()
                copier.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copier):
                    dev.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                held += [host, dev]
            elif probe == "index-default":  # the index probe on the default stream
                held += index_scatter()
                torch.cuda.synchronize()
            elif probe == "kernel":  # kernels the engine never ran, on the default stream
                steps = torch.arange(4096, device="cuda", dtype=torch.float64) * 1e-4 + 1
                held.append(torch.cumprod(steps, 0))
                torch.cuda.synchronize()
            elif probe in CAPTURE_STREAM_PROBES:
                held.append(on_capture_stream(probe, graphs.capture_stream, eng.tier))
            elif probe in ("swap", "swap-traced"):
                swapped = swap_run(llm, traced=probe == "swap-traced")
                rows.append({"probe_run": probe, **swapped})
                sys.stdout.write(f"{probe}: {json.dumps(swapped)}\n")
            if probe == "capture":  # the replays themselves run on the capture stream
                stream = graphs.capture_stream
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    times, _ = time_graphs(graphs, graphs.graphs, buckets, args, geometry)
                torch.cuda.current_stream().wait_stream(stream)
            else:
                times, side = time_graphs(graphs, graphs.graphs, buckets, args, geometry)
            rows.append({"probe": probe, "replay_ms": times, "clocks": side.get("clocks")})
            report(f"capture after probe {probe}", times, side)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_replay.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
