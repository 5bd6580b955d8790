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
after the captures (work on a new stream, pinned host memory, a device segment) and
times the graphs after each.

Found with it (H200, torch 2.11): the engine's graphs replay ~0.17 ms slower at 32 rows
(430 kernels) once work has run on a further stream of the process, and stay so. The
graphs themselves are not the cause: the first capture's graphs, kept, slow down as much.

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


PROBES = ("malloc", "pin", "stream")


def parse_probes(text: str) -> list[str]:
    """--probes: names in order, repeats kept (each `stream` is one more stream)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown probes {unknown}; known: {', '.join(PROBES)}")
    return names


def time_graphs(graphs, table: dict, buckets, args, geometry, side_stream=None):
    """Replay ms of each of `buckets` in `table` (bucket -> graph), on the current stream
    and, with side_stream, on that one too; the static inputs staged for each."""
    import torch

    times, side = {}, {}
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
    return times, side


def report(label: str, times: dict, side: dict) -> None:
    cells = ", ".join(
        f"bs {bs}: {ms:.3f}" + (f" ({side[bs]:.3f})" if bs in side else "")
        for bs, ms in times.items()
    )
    sys.stdout.write(f"{label}: {cells} ms\n")
    sys.stdout.flush()


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
        "the tier pins), stream (work on a new stream of torch's pool)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_replay.py times CUDA graphs: it needs a GPU")
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
        graphs = eng.runner.graphs
        geometry = (eng.config.page_size, eng.kv.allocator.num_pages)
        make_stream = torch.cuda.Stream
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
            else:  # stream
                with torch.cuda.stream(make_stream()):
                    held.append(torch.ones(1 << 20, device="cuda") * 2)
                torch.cuda.synchronize()
            times, _ = time_graphs(graphs, graphs.graphs, buckets, args, geometry)
            rows.append({"probe": probe, "replay_ms": times})
            report(f"capture after probe {probe}", times, {})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_replay.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
