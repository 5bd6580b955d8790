"""How long pinning a host pool takes, by the way it is pinned.

    python3 benchmarks/host_pin.py --gib 16                  # GPU: every mode below
    python3 benchmarks/host_pin.py --gib 1 --modes touch-1,touch-all   # CPU: the touch alone

A host tier of tens of GiB is pinned while the engine builds; its time is start-up the
user waits through. Each mode makes a fresh buffer of --gib GiB, times it, and frees it
before the next:

- `batchgen` (GPU): `kv.pinned.host_empty(..., pin=True)` as the engine makes its host
  pools: an anonymous map, its pages faulted in by torch's intra-op threads, then
  `cudaHostRegister`.
- `register-only` (GPU): the same with the first touch left out, so registration faults
  every page in itself, on one thread (batchgen before it touched them first).
- `torch-pinned` (GPU): `torch.empty(..., pin_memory=True)`, torch's caching host
  allocator (`cudaHostAlloc`; it rounds the size up to a power of two).
- `touch-1`, `touch-all` (CPU or GPU): the first touch alone (`pinned._prefault`) on one
  thread and on torch's intra-op threads (torch.get_num_threads(); one where the process
  spans NUMA nodes, as batchgen does).

Prints one line a mode (seconds, GiB/s) and writes host_pin.json with --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import sys
import time
from pathlib import Path

import torch

from batchgen.kv import pinned

MODES = ("batchgen", "register-only", "torch-pinned", "touch-1", "touch-all")
GPU_MODES = ("batchgen", "register-only", "torch-pinned")


def pin_seconds(mode: str, nbytes: int) -> float:
    """Seconds to make one buffer of nbytes in `mode` (the buffer freed after)."""
    start = time.perf_counter()
    if mode == "batchgen":
        buf = pinned.host_empty((nbytes,), torch.uint8, pin=True)
    elif mode == "register-only":
        touch, pinned._prefault = pinned._prefault, lambda memory: None
        try:
            buf = pinned.host_empty((nbytes,), torch.uint8, pin=True)
        finally:
            pinned._prefault = touch
    elif mode == "torch-pinned":
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        threads = torch.get_num_threads()
        buf = mmap.mmap(-1, nbytes)
        if mode == "touch-1":
            torch.set_num_threads(1)
        try:
            pinned._prefault(buf)
        finally:
            torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    del buf
    gc.collect()
    if mode == "torch-pinned":  # the caching host allocator keeps the block otherwise
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="buffer size (GiB)")
    ap.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, in order, from {', '.join(MODES)} "
        "(default: all on a GPU, the touch modes elsewhere)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.modes is None:
        modes = list(MODES if gpu else ("touch-1", "touch-all"))
    else:
        modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown} (choose from {', '.join(MODES)})")
    needs_gpu = [m for m in modes if m in GPU_MODES]
    if needs_gpu and not gpu:
        sys.exit(f"modes {needs_gpu} pin memory with CUDA: they need a GPU")
    if args.gib <= 0:
        ap.error("--gib must be positive")
    nbytes = int(args.gib * 2**30)
    results = []
    for mode in modes:
        seconds = pin_seconds(mode, nbytes)
        results.append({"mode": mode, "seconds": seconds, "gib_per_s": args.gib / seconds})
        print(f"{mode:14s} {seconds:8.3f} s  {args.gib / seconds:7.2f} GiB/s")
    summary = {"gib": args.gib, "threads": torch.get_num_threads(), "results": results}
    print(f"({args.gib} GiB each; {summary['threads']} intra-op threads)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_pin.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
