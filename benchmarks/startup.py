"""How long an engine takes to build, phase by phase.

    python3 -m benchmarks.startup                        # the embedded default model, CPU
    python3 -m benchmarks.startup --model DIR --device cuda
    python3 -m benchmarks.startup --model kimi-w6 --device cuda   # W6's engine, random weights
    python3 -m benchmarks.startup --model kimi-w6 --device cuda --record-tuning T.json
    python3 -m benchmarks.startup --parse-each-read      # GGUF read as before gguf_read_once

A batch job waits for the engine before its first step. This builds `LLM(...)` once in
this process and reports the seconds of each phase of EngineCore.from_config: the
config, the tokenizer, the weights (build_model) and the rest (the memory plan, warm-up
steps, CUDA graphs, the host tier). `--parse-each-read` leaves models.gguf_share's
gguf_read_once out, so that transformers parses a GGUF file once for each read, as
before it: run it in a process of its own for the comparison (a process's first build
also pays its imports: the first of two runs in one machine is the slower).
Prints the phases and writes startup.json with --out.

--model also takes a workloads.MODELS name: W1's (qwen3-0.6b), W4's (moonlight-w4) or
W6's (kimi-w6) model with random weights drawn on the device (load_format="dummy", the
directory holds config.json only; --small: the CPU-sized one), built as its benchmark
builds it (max_model_len for its requests, W4's and W6's host tier of 32 GiB). The
engine phase is then split further ("engine_s"): the Triton kernels made ready from the
shipped table (kernel_prep), the warm-up profile and memory plan (resolve_plan), the
host tier's cost rule (tier_cost), the runner with its CUDA graphs (build_runner), and
the rest; with the number of Triton compiles the build made. --first-requests then runs
the warm-up its benchmark runs before timing (the first steps of new shapes may still
compile or autotune) and reports its seconds and compiles apart.

--record-tuning PATH (on a GPU) writes what this build decided into the table at PATH
under this GPU's name (torch.cuda.get_device_name), keeping the other GPUs' sections:
every Autotuner's decisions (kernels/autotune_table.py) and every compile's
specialization (kernels/precompile.py), those of --first-requests included. Record on a machine whose Triton cache holds
nothing of the model, then copy the table to src/batchgen/kernels/autotune_table.json
(package data): a build on that GPU then neither benchmarks nor compiles one by one.
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
from batchgen.engine import builder, builder_load
from batchgen.engine.builder_plan import Warmup
from batchgen.kernels import autotune_table
from batchgen.kernels.precompile import CompileWatch, chosen_only
from batchgen.models import loader
from benchmarks.engine_runs import timed_into
from benchmarks.moe_runs import warm_up_prompts
from benchmarks.workloads import MODELS, config_dir, small_requests, w1_requests, w4_requests

PHASES = ("config", "tokenizer", "weights")
ENGINE_PHASES = ("kernels", "plan", "tier_cost", "runner")
# the models --model names, as their benchmarks build them: requests, max_model_len,
# host tier GiB (None: the engine's default)
BENCHMARK_MODELS = {
    "qwen3-0.6b": (w1_requests, 2048, None),  # throughput.py
    "moonlight-w4": (w4_requests, 1024 + 128 + 16, 32.0),  # mla.py
    "kimi-w6": (w4_requests, 1024 + 128 + 16, 32.0),  # hybrid.py
}


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


@contextlib.contextmanager
def engine_timer(spent: dict[str, float]):
    """Seconds of build_engine's parts, added to `spent` under ENGINE_PHASES' names:
    entering kernel_prep.kernels_prepared, resolve_plan, Warmup.tier_cost, build_runner."""
    saved = (builder.kernels_prepared, builder.resolve_plan, Warmup.tier_cost, builder.build_runner)

    @contextlib.contextmanager
    def kernels(*a, **k):
        t0 = time.perf_counter()
        with saved[0](*a, **k) as watch:
            spent["kernels"] = spent.get("kernels", 0.0) + time.perf_counter() - t0
            yield watch

    builder.kernels_prepared = kernels
    builder.resolve_plan = timed_into(spent, "plan", saved[1])
    Warmup.tier_cost = timed_into(spent, "tier_cost", saved[2])
    builder.build_runner = timed_into(spent, "runner", saved[3])
    try:
        yield
    finally:
        builder.kernels_prepared, builder.resolve_plan = saved[:2]
        Warmup.tier_cost, builder.build_runner = saved[2:]


def model_kwargs(name: str | None, small: bool, ckpt: Path | None = None) -> dict:
    """LLM(...) arguments for --model: a BENCHMARK_MODELS name as its benchmark builds it
    (config.json only, weights drawn on the device), else the directory (or None: the
    default model) as it is. `ckpt`: the directory for a named model's config.json
    (default /tmp/batchgen-<name>-config, + "-small")."""
    if name not in BENCHMARK_MODELS:
        return dict(model=name)
    full, cpu_sized = MODELS[name]
    _, max_len, host_gib = BENCHMARK_MODELS[name]
    path = ckpt or Path(f"/tmp/batchgen-{name}-config" + "-small" * small)
    kwargs = dict(
        model=str(config_dir(path, cpu_sized if small else full)),
        load_format="dummy",
        max_model_len=max_len,
    )
    if host_gib is not None:
        kwargs["host_kv_size_gib"] = 0.01 if small else host_gib
    return kwargs


def first_requests(llm, name: str, small: bool) -> float:
    """The untimed warm-up the model's benchmark runs after the build (W1: its first 4
    prompts for 8 tokens; W4, W6: moe_runs' full prefill, mixed and continued steps for
    4 tokens; --small: CPU-sized prompts), greedy; returns its seconds."""
    from batchgen import SamplingParams

    requests = BENCHMARK_MODELS[name][0]
    if requests is w1_requests:
        prompts = small_requests(4)[0] if small else requests()[0][:4]
        max_tokens = 8
    else:
        shape = dict(n=6, prompt_len=70, out_len=6, max_token=500) if small else {}
        prompts = requests(**shape)[0]
        prompts = [p[::-1] for p in prompts[: warm_up_prompts(llm, len(prompts[0]))]]
        max_tokens = 4
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def record_tuning(
    path: Path, gpu: str, watch: CompileWatch, prefixes=autotune_table.KERNEL_PACKAGES
) -> dict:
    """Write this process's autotuning decisions (of the kernels under `prefixes`) and
    the compiles `watch` recorded into the table at `path` as `gpu`'s section; returns
    the section (with the Triton and fla-core versions it was recorded with)."""
    import importlib.metadata

    import torch
    import triton

    try:
        fla = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        fla = None
    capability = None
    if torch.cuda.is_available():
        capability = ".".join(map(str, torch.cuda.get_device_capability()))
    section = {
        "triton": triton.__version__,
        "capability": capability,
        "fla-core": fla,
        "autotune": autotune_table.record_decisions(prefixes),
        "compile": chosen_only(watch.specs),
    }
    autotune_table.write_section(path, gpu, section)
    return section


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="a directory, or W1's/W4's/W6's model: "
        + ", ".join(BENCHMARK_MODELS)
        + " (default: the embedded default model)",
    )
    ap.add_argument("--small", action="store_true", help="a named model's CPU-sized version")
    ap.add_argument("--ckpt", type=Path, default=None, help="a named model's config directory")
    ap.add_argument(
        "--first-requests",
        action="store_true",
        help="then a named model's benchmark warm-up (timed, and recorded with the build)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--record-tuning",
        type=Path,
        default=None,
        help="write this GPU's autotuning decisions and compiles into the table at PATH",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--parse-each-read", action="store_true", help="without gguf_read_once")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda needs a GPU")
    if args.record_tuning is not None and not args.device.startswith("cuda"):
        sys.exit("--record-tuning records a GPU's decisions: give --device cuda")
    spent: dict[str, float] = {}
    engine: dict[str, float] = {}
    saved = builder_load.gguf_read_once
    if args.parse_each_read:
        builder_load.gguf_read_once = contextlib.nullcontext
    try:
        with phase_timer(spent), engine_timer(engine), CompileWatch(record=True) as watch:
            start = time.perf_counter()
            kwargs = model_kwargs(args.model, args.small, args.ckpt)
            llm = LLM(**kwargs, device=args.device, dtype=args.dtype)
            total = time.perf_counter() - start
            build_compiles, first_s = watch.count, None
            if args.first_requests and args.model in BENCHMARK_MODELS:
                first_s = first_requests(llm, args.model, args.small)
    finally:
        builder_load.gguf_read_once = saved
    phases = {name: spent.get(name, 0.0) for name in PHASES}
    phases["engine"] = total - sum(phases.values())
    engine_s = {name: engine.get(name, 0.0) for name in ENGINE_PHASES}
    engine_s["rest"] = phases["engine"] - sum(engine_s.values())
    result = {
        "model": args.model or "default",
        "device": args.device,
        "parse_each_read": args.parse_each_read,
        "total_s": total,
        "phases_s": phases,
        "engine_s": engine_s,
        "compiles": build_compiles,
        "first_requests_s": first_s,
        "first_requests_compiles": watch.count - build_compiles,
        "kv_pages": llm.engine.kv.allocator.num_pages,
    }
    if args.record_tuning is not None:
        gpu = torch.cuda.get_device_name(torch.device(args.device).index)
        section = record_tuning(args.record_tuning, gpu, watch)
        result["recorded"] = {
            "gpu": gpu,
            "autotune_keys": sum(len(v) for v in section["autotune"].values()),
            "compiles": sum(len(v) for v in section["compile"].values()),
        }
        print(f"recorded for {gpu}: {json.dumps(result['recorded'])} -> {args.record_tuning}")
    for name, seconds in phases.items():
        print(f"{name:10s} {seconds:7.2f} s")
    for name, seconds in engine_s.items():
        print(f"  {name:10s} {seconds:7.2f} s")
    print(f"{'compiles':10s} {build_compiles:7d}")
    if first_s is not None:
        print(
            f"{'first reqs':10s} {first_s:7.2f} s (the benchmark's warm-up after the build, "
            f"{watch.count - build_compiles} compiles)"
        )
    print(f"{'total':10s} {total:7.2f} s" + ("  (GGUF parsed per read)" * args.parse_each_read))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
