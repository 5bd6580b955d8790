"""How long an engine takes to build, phase by phase.

    python3 -m benchmarks.startup                        # the embedded default model, CPU
    python3 -m benchmarks.startup --model DIR --device cuda
    python3 -m benchmarks.startup --parse-each-read      # GGUF read as before gguf_read_once

A batch job waits for the engine before its first step. This builds `LLM(...)` once in
this process and reports the seconds of each phase of EngineCore.from_config: the
config, the tokenizer, the weights (build_model) and the rest (the memory plan, warm-up
steps, CUDA graphs, the host tier). `--parse-each-read` leaves models.loader's
gguf_read_once out, so that transformers parses a GGUF file once for each read, as
before it: run it in a process of its own for the comparison (a process's first build
also pays its imports: the first of two runs in one machine is the slower).
Prints the phases and writes startup.json with --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from batchgen import LLM
from batchgen.engine import builder_load
from batchgen.models import loader
from benchmarks.engine_runs import timed_into

PHASES = ("config", "tokenizer", "weights")


@contextlib.contextmanager
def phase_timer(spent: dict[str, float]):
    """Seconds in ModelSource.load_config, load_tokenizer and build_model (as
    builder_load calls it), added to `spent` under PHASES' names."""
    source = loader.ModelSource
    saved = (source.load_config, source.load_tokenizer, builder_load.build_model)
    source.load_config = timed_into(spent, "config", saved[0])
    source.load_tokenizer = timed_into(spent, "tokenizer", saved[1])
    builder_load.build_model = timed_into(spent, "weights", saved[2])
    try:
        yield
    finally:
        source.load_config, source.load_tokenizer, builder_load.build_model = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--parse-each-read", action="store_true", help="without gguf_read_once")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda needs a GPU")
    spent: dict[str, float] = {}
    saved = builder_load.gguf_read_once
    if args.parse_each_read:
        builder_load.gguf_read_once = contextlib.nullcontext
    try:
        with phase_timer(spent):
            start = time.perf_counter()
            llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
            total = time.perf_counter() - start
    finally:
        builder_load.gguf_read_once = saved
    phases = {name: spent.get(name, 0.0) for name in PHASES}
    phases["engine"] = total - sum(phases.values())
    result = {
        "model": args.model or "default",
        "device": args.device,
        "parse_each_read": args.parse_each_read,
        "total_s": total,
        "phases_s": phases,
        "kv_pages": llm.engine.kv.allocator.num_pages,
    }
    for name, seconds in phases.items():
        print(f"{name:10s} {seconds:7.2f} s")
    print(f"{'total':10s} {total:7.2f} s" + ("  (GGUF parsed per read)" * args.parse_each_read))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
