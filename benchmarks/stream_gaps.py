"""How long each kernel of a replayed CUDA graph takes, before and after other work in
the process, each scenario in a fresh process (a fresh CUDA context).

On the GPU (from the repository root):

    PYTHONPATH=src python3 benchmarks/stream_gaps.py --out $OUT

graph_replay.py found the engine's decode graphs replaying ~0.4 us slower per kernel
once work had run on a further stream of the process. This script asks the same of a
synthetic graph (--kernels small in-place adds, so the time between kernels dominates)
in scenarios that differ in one thing: which stream the graph was captured on, which it
replays on, and what ran where after the first timing. Each scenario is one process: it
captures, times the replay (CUDA events around --replays back-to-back replays, median
of five batches, divided by --kernels), does its probe, and times again.

Scenarios (name: the probe between the two timings):
  none           nothing (the control: the same times twice)
  new-stream     a kernel on a new stream of torch's pool
  two-streams    a kernel on each of two new streams
  capture        a kernel on the stream the graph was captured on
  copy           a pinned host-to-device copy on a new stream (no kernel)
  high-priority  a kernel on a new high-priority stream
  on-capture     as new-stream, but the graph replays on its capture stream throughout
  one-connection as new-stream, under CUDA_DEVICE_MAX_CONNECTIONS=1

Found with it (H200, torch 2.11, 400 kernels): about 0.944 us a kernel in every
scenario, before and after (within 0.003 us): the synthetic graph does not show what
the engine's decode graphs show.

Writes stream_gaps.json into --out and prints one line per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SCENARIOS = (
    "none",
    "new-stream",
    "two-streams",
    "capture",
    "copy",
    "high-priority",
    "on-capture",
    "one-connection",
)


def per_kernel_us(graph, replays: int, kernels: int) -> float:
    """graph_replay's timing (median of five batches of back-to-back replays) a kernel."""
    from graph_replay import replay_ms

    return replay_ms(graph, replays) * 1e3 / kernels


def scenario(name: str, kernels: int, replays: int) -> dict:
    """One scenario in this process: the per-kernel replay time before and after."""
    import torch

    x = torch.zeros(4096, device="cuda")
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture_stream):
        x.add_(1)  # warm-up on the capture stream, as the engine's capture does
        with torch.cuda.graph(graph, stream=capture_stream):
            for _ in range(kernels):
                x.add_(1)
    torch.cuda.current_stream().wait_stream(capture_stream)
    torch.cuda.synchronize()
    replay_stream = capture_stream if name == "on-capture" else torch.cuda.current_stream()

    def timed() -> float:
        replay_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(replay_stream):
            us = per_kernel_us(graph, replays, kernels)
        torch.cuda.current_stream().wait_stream(replay_stream)
        return us

    before = timed()
    held = []
    if name in ("new-stream", "on-capture", "one-connection", "two-streams", "high-priority"):
        count = 2 if name == "two-streams" else 1
        priority = -1 if name == "high-priority" else 0
        for _ in range(count):
            with torch.cuda.stream(torch.cuda.Stream(priority=priority)):
                held.append(torch.ones(1 << 20, device="cuda") * 2)
    elif name == "capture":
        with torch.cuda.stream(capture_stream):
            held.append(torch.ones(1 << 20, device="cuda") * 2)
    elif name == "copy":
        host = torch.ones(1 << 20).pin_memory()
        with torch.cuda.stream(torch.cuda.Stream()):
            held.append(host.to("cuda", non_blocking=True))
    torch.cuda.synchronize()
    after = timed()
    return {"scenario": name, "before_us": before, "after_us": after}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--kernels", type=int, default=400)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one scenario
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    if args.one:
        sys.stdout.write(json.dumps(scenario(args.one, args.kernels, args.replays)) + "\n")
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("stream_gaps.py times CUDA graphs: it needs a GPU")
    rows = []
    for name in names:
        env = dict(os.environ)
        if name == "one-connection":
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        cmd = [sys.executable, __file__, "--one", name]
        cmd += ["--kernels", str(args.kernels), "--replays", str(args.replays)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"scenario {name} failed:\n{done.stderr}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        sys.stdout.write(
            f"{name:>15}: {row['before_us']:.3f} -> {row['after_us']:.3f} us a kernel "
            f"({row['after_us'] - row['before_us']:+.3f})\n"
        )
        sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_gaps.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
