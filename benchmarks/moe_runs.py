"""The run W4 (mla.py) and W6 (hybrid.py) share: batchgen timed over the 512x128 decode
probe (workloads.w4_requests) after a warm-up shaped like it, with its prefill and decode
phases, slowest steps, compiles, collector pauses and allocator counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from benchmarks.card import sync
from benchmarks.engine_runs import (
    add_engine_args,
    allocator_stats,
    compile_log,
    engine_kwargs,
    gc_pauses,
    phase_table,
    step_phases,
)
from benchmarks.workloads import config_dir, w4_requests


def slowest_steps(step_ms: list[float], step_tokens: list[int], n: int = 6) -> list[str]:
    """The n slowest steps as "#index ms (tokens)", against the median of steps that
    computed as many tokens: first-call costs (kernel compilation, autotuning) stand out."""
    by_tokens: dict[int, list[float]] = {}
    for ms, tokens in zip(step_ms, step_tokens):
        by_tokens.setdefault(tokens, []).append(ms)
    median = {t: sorted(v)[len(v) // 2] for t, v in by_tokens.items()}
    order = sorted(range(len(step_ms)), key=lambda i: -step_ms[i])[:n]
    return [
        f"#{i} {step_ms[i]:.1f} ms ({step_tokens[i]} tokens; median "
        f"{median[step_tokens[i]]:.1f} ms over {len(by_tokens[step_tokens[i]])} such steps)"
        for i in order
    ]


def warm_up_prompts(llm, prompt_len: int) -> int:
    """Prompts of prompt_len that take the engine through a full prefill step, a mixed
    step that cuts a prompt at the token budget, and that prompt's continuation."""
    per_step = max(1, llm.engine.config.max_num_batched_tokens // prompt_len)
    return 2 * per_step + 1


def workload_kwargs(prompts, out_lens, args) -> dict:
    """The LLM options the workload runs with: dummy weights, room for the longest
    prompt and output, args' dtype, device, host tier and engine options."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        load_format="dummy",
        max_model_len=max(len(p) for p in prompts) + max(out_lens) + 16,
        host_kv_size_gib=args.host_gib,
        **engine_kwargs(args),
    )


def workload_llm(ckpt: Path, prompts, out_lens, args):
    """The engine the workload runs on: ckpt's config with workload_kwargs."""
    from batchgen import LLM

    return LLM(model=str(ckpt), **workload_kwargs(prompts, out_lens, args))


def warm_up(llm, prompts) -> None:
    """The untimed warm-up run_batchgen explains: warm_up_prompts of the first prompts,
    reversed (no page of them is a workload prefix), four tokens each."""
    from batchgen import SamplingParams

    warm = [p[::-1] for p in prompts[: warm_up_prompts(llm, len(prompts[0]))]]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def run_batchgen(ckpt: Path, prompts, out_lens, args) -> dict:
    from batchgen import SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    built = time.perf_counter()
    llm = workload_llm(ckpt, prompts, out_lens, args)
    # untimed warm-up shaped like the workload, as the peer's warm-up batch is: a full
    # prefill step, a mixed step (the first requests decoding, a prompt cut at the
    # budget) and the step after it (that prompt continued over its cached part), then
    # decode steps, so the first-call costs (Triton compiling a kernel for a new
    # specialisation, autotuning) fall here: two budgets' worth of prompts, and one.
    # The prompts are the first ones reversed: no page of them is a workload prefix.
    warming = time.perf_counter()
    # progress on stderr: a run cut off by a time limit shows which phase it was in
    sys.stderr.write(f"built in {warming - built:.1f} s; warming up\n")
    sys.stderr.flush()
    warm_up(llm, prompts)
    startup = {"build_s": warming - built, "warmup_s": time.perf_counter() - warming}
    sys.stderr.write(f"warmed up in {startup['warmup_s']:.1f} s; timing the workload\n")
    sys.stderr.flush()
    eng = llm.engine
    sync(args.device)
    steps = 0
    # --step-phases: the host ms of each step in the engine calls engine_runs.PHASES names
    phases = step_phases(eng) if getattr(args, "step_phases", False) else nullcontext(None)
    with (
        fewer_full_collections(),
        compile_log(lambda: steps) as compiles,
        gc_pauses() as collections,
        phases as take_phases,
    ):
        before = eng.metrics()
        alloc_before = allocator_stats(args.device)
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            eng.add_request(f"w4-{i}", p, params)
        added_s = time.perf_counter() - start  # the first step's time includes it
        out0 = eng.stats.output_tokens
        # the prefill phase ends when every request has its first token (the output-token
        # count alone would end it early: requests admitted first decode meanwhile)
        first_all = None
        step_ms, step_tokens = [], []  # per step as run (pipelined: not each step's own GPU time)
        computed = eng.scheduler.num_computed_tokens_total
        last = start
        # --allocator-steps: the allocator's cudaMalloc calls and retries so far, a step
        alloc_steps = [] if getattr(args, "allocator_steps", False) and alloc_before else None
        phase_rows = None
        if take_phases is not None:
            take_phases()  # adding the requests is no step's
            phase_rows = []
        while eng.has_unfinished:
            eng.step()
            steps += 1
            now = time.perf_counter()
            if phase_rows is not None:
                phase_rows.append(take_phases())
            step_ms.append(round((now - last) * 1000, 2))
            step_tokens.append(eng.scheduler.num_computed_tokens_total - computed)
            computed, last = eng.scheduler.num_computed_tokens_total, now
            if alloc_steps is not None:
                counts = allocator_stats(args.device, alloc_before)
                alloc_steps.append([counts["device_mallocs"], counts["alloc_retries"]])
                last = time.perf_counter()  # reading the counters is no step's time
            if first_all is None and not any(not r.output_token_ids for r in eng.requests.values()):
                first_all = now - start
    sync(args.device)
    wall = time.perf_counter() - start
    after = eng.metrics()
    alloc = allocator_stats(args.device, alloc_before)
    out = eng.stats.output_tokens - out0
    first_all = wall if first_all is None else first_all
    counters = {
        k: after[k] - before.get(k, 0)
        for k in after
        if isinstance(after[k], (int, float)) and not k.startswith("tier_")
    }
    result = {
        "wall_s": wall,
        "output_tokens": out,
        "tok_s": out / wall,
        "cuda_graphs": eng.runner.graphs is not None,
        # asked for and used: the engine may decline it
        "async_scheduling": eng.overlap.name == "async",
        "backend": eng.runner.attention_backend,
        "steps": steps,
        "prefill_phase_s": first_all,
        "decode_phase_s": wall - first_all,
        "decode_tok_s": (out - len(prompts)) / max(wall - first_all, 1e-9),
        "counters": counters,
        "kv_pool_pages": eng.kv.allocator.num_pages,
        "add_requests_s": added_s,
        "startup": startup,  # engine build (weights, memory plan, graphs) and warm-up
        "slowest_steps": slowest_steps(step_ms, step_tokens),
        "step_ms": step_ms,
        "step_tokens": step_tokens,
        "compiles_after_warmup": compiles,  # Triton specialisations the timed run met first
        "gc_pauses": collections,  # the cyclic collector's, in the timed run
        # the caching allocator in the timed run (None on the CPU): a retry frees its
        # cache and synchronises, a cudaMalloc of a new segment can take milliseconds
        "allocator": alloc,
        "allocator_steps": alloc_steps,  # [cudaMalloc, retries] so far, a step
        "step_phases": None if phase_rows is None else phase_table(phase_rows),
    }
    if args.profile:
        from benchmarks.profiles import profile_decode

        result["profile"] = profile_decode(llm, prompts, args, max_tokens=max(out_lens) + 16)
    if args.profile_prefill:
        from benchmarks.profiles import profile_prefill

        result["profile_prefill"] = profile_prefill(llm, prompts)
    if eng.tier is not None:
        eng.tier.copies.close()
    eng.shutdown()
    return result


def release_device_memory() -> None:
    """Collect the finished engine and give its pool back (the peer runs next)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batchgen_line(ours: dict, extra: str = "") -> str:
    """run_batchgen's rate, time, steps, phases and modes as a printed line, `extra`
    (", name value") after the modes."""
    return (
        f"batchgen     {ours['tok_s']:10.1f} output tok/s ({ours['wall_s']:.2f} s, "
        f"{ours['steps']} steps; prefill phase {ours['prefill_phase_s']:.2f} s, decode "
        f"{ours['decode_tok_s']:.1f} tok/s; graphs {ours['cuda_graphs']}, async scheduling "
        f"{ours['async_scheduling']}{extra})"
    )


def peer_line(peer: dict, ratio: float, extra: str = "") -> str:
    """peers.padded_generate's rate and time (and its timed batches where it timed some)
    as a printed line, `extra` (", name value") after them, then batchgen's ratio to it."""
    timed = f", {peer['timed_batches']} timed batches" if "timed_batches" in peer else ""
    return (
        f"transformers {peer['tok_s']:10.1f} output tok/s ({peer['wall_s']:.2f} s{timed}"
        f"{extra}) -> ratio {ratio:.1f}x"
    )


def run_lines(ours: dict) -> list[str]:
    """run_batchgen's slowest steps, untimed start-up, Triton specialisations met after
    the warm-up and the collector's pauses, a printed line each (W4 and W6 alike)."""
    compiles = ours["compiles_after_warmup"]
    return [
        "slowest      " + "; ".join(ours["slowest_steps"]),
        "untimed      build {build_s:.1f} s, warm-up {warmup_s:.1f} s".format(**ours["startup"]),
        f"compiles     {len(compiles)} Triton specialisations after the warm-up"
        + "".join(f"\n  {c}" for c in compiles[:12]),
        "gc pauses    " + json.dumps(ours["gc_pauses"]),
    ] + allocator_lines(ours.get("allocator"), ours.get("allocator_steps"))


def allocator_lines(alloc: dict | None, steps: list | None = None) -> list[str]:
    """The timed run's allocator counters as a printed line (none on the CPU); with
    --allocator-steps, the steps that called cudaMalloc or retried, and how often."""
    if alloc is None:
        return []
    lines = [
        f"allocator    {alloc['device_mallocs']} cudaMalloc, {alloc['device_frees']} cudaFree, "
        f"{alloc['alloc_retries']} retries in the timed run; {alloc['segments']} segments, "
        f"reserved peak {alloc['reserved_peak_bytes'] / 2**30:.2f} GiB"
    ]
    if steps:
        cells, previous = [], [0, 0]
        for i, now in enumerate(steps):
            mallocs, retries = now[0] - previous[0], now[1] - previous[1]
            if mallocs or retries:
                cells.append(
                    f"#{i} {mallocs} cudaMalloc" + (f" {retries} retries" if retries else "")
                )
            previous = now
        lines.append("  by step    " + ("; ".join(cells) if cells else "none"))
    return lines


def add_workload_args(ap: argparse.ArgumentParser, peer_batches: int, peer_help: str) -> None:
    """The flags mla.py and hybrid.py share: --small, --skip-peer, --host-gib,
    --peer-batches (its default and help the script's), --profile, --profile-prefill,
    --allocator-steps and --step-phases (run_batchgen reads them), the engine's
    (engine_runs.add_engine_args), and --ckpt's default (config_dir's folder)."""
    ap.add_argument("--small", action="store_true", help="tiny model and workload on the CPU")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--host-gib", type=float, default=32.0)
    ap.add_argument("--peer-batches", type=int, default=peer_batches, help=peer_help)
    ap.add_argument(
        "--profile", action="store_true", help="+ where a decode step's time goes (profiles.py)"
    )
    ap.add_argument(
        "--profile-prefill",
        action="store_true",
        help="+ where a prefill step's time goes (profiles.profile_prefill)",
    )
    ap.add_argument(
        "--allocator-steps",
        action="store_true",
        help="+ the caching allocator's counters after every step (GPU), so the steps that "
        "called cudaMalloc or retried are named; off by default, reading them costs a little",
    )
    ap.add_argument(
        "--step-phases",
        action="store_true",
        help="+ each step's host ms in the engine calls engine_runs.PHASES names (waiting "
        "for a queued step's tokens is `result`): which steps the host or the GPU bounds",
    )
    add_engine_args(ap)
    ap.set_defaults(ckpt=None)


def w4_workload(args, config: dict, small_config: dict, name: str, small_prompt_len: int):
    """W4's requests (workloads.w4_requests) and the folder of the model's config.json:
    on the GPU in bf16, or with --small six requests of small_prompt_len tokens on the CPU
    in float32 over small_config, a 0.01 GiB host tier. Sets args.device and args.dtype
    (and args.host_gib with --small); the folder is --ckpt or /tmp/batchgen-<name>-config
    (-small-config)."""
    if args.small:
        prompts, out_lens = w4_requests(n=6, prompt_len=small_prompt_len, out_len=6, max_token=500)
        args.device, args.dtype, args.host_gib = "cpu", "float32", 0.01
        folder = args.ckpt or Path(f"/tmp/batchgen-{name}-small-config")
        return prompts, out_lens, config_dir(folder, small_config, "float32")
    prompts, out_lens = w4_requests()
    args.device, args.dtype = "cuda", "bfloat16"
    return prompts, out_lens, config_dir(args.ckpt or Path(f"/tmp/batchgen-{name}-config"), config)


def print_run(lines: list[str], ours: dict, out_lens: list[int]) -> int:
    """Prints lines, then run_batchgen's decode and prefill profiles where it took them;
    the script's exit status: 0 if every request got its output tokens, else 1."""
    for key in ("profile", "profile_prefill"):
        if key in ours:
            lines.append(json.dumps(ours[key], indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if ours["output_tokens"] == sum(out_lens) else 1
