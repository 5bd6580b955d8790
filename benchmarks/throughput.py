"""W1 `nano`: batchgen vs transformers' continuous batching (paged|sdpa) in one run.

    python3 -m benchmarks.throughput                 # W1 on the GPU, peer beside it
    python3 -m benchmarks.throughput --skip-peer     # while iterating (not a result)
    python3 -m benchmarks.throughput --small         # CPU, seconds, for CI
    python3 -m benchmarks.throughput --profile       # + where a decode step's time goes
    python3 -m benchmarks.throughput --busy          # + the GPU's busy ms a step, by rows
    python3 -m benchmarks.throughput --sampling all  # sampled decoding beside greedy

--sampling greedy|sampled|top_k|penalty|all: batchgen alone (no peer), one engine, the
workload run greedy first and then as asked: `sampled` temperature 0.8 + top_p 0.95 with
a seed per request, `top_k` that + top_k 50, `penalty` that + repetition_penalty 1.1
(`all`: the three), each after an untimed warm-up of its own (the decode graphs that
sample inside them are captured there); prints each run's output tok/s and its ratio to
greedy, writes sampling.json. Each run's prompts start with their own first token, so no run takes
pages from the prefix cache an earlier one left.

Prints output tok/s for both, their ratio and batchgen's fraction of the roofline
(roofline.py) at this card's ceilings, measured before the engine builds (card.ceilings;
the H200's constants only with --constant-ceilings or where measuring fails, with a
warning), and at the H200's constants beside it for older records; writes
throughput.json and throughput.png into --out.

`by_rows` (always; from the timed run's timeline, so nothing is added to the timed loop):
the decode steps bucketed by running requests, each bucket's wall ms a step beside the
roofline's ms a step for the same number of live requests (weights and live KV read once),
and the prefill phase's seconds beside its roofline: where the run loses to the roofline.
--busy runs the workload once more on the same engine (each prompt's first token changed,
so no page comes from the prefix cache) with CUDA events around each step's GPU calls
(chat_job.StepMeter) and adds each bucket's GPU busy ms a step: a bucket whose wall exceeds
its busy time by much waits on the host, one whose busy time exceeds its roofline is the
kernels' (the events themselves cost a little: that run is not the timed one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.card import ceilings as card_ceilings
from benchmarks.card import sync
from benchmarks.engine_runs import add_engine_args, engine_kwargs
from benchmarks.peers import continuous_batching
from benchmarks.profiles import fresh_prompts, profile_decode
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
    sync(args.device)
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
    sync(args.device)
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
    if args.busy:
        result["busy"] = busy_run(llm, prompts, out_lens, args.device)
    if args.profile:
        result["profile"] = profile_decode(llm, prompts, args)
    return result, timeline


def busy_run(llm, prompts, out_lens, device: str) -> dict:
    """The workload again under StepMeter (module docstring): per step, the running
    requests, the wall ms and the GPU busy ms (None on the CPU)."""
    from batchgen import SamplingParams
    from benchmarks.chat_job import StepMeter, on_gpu

    eng = llm.engine
    gpu = on_gpu(device)
    rows, ends = [], []
    with StepMeter(gpu) as meter:
        for i, (p, n) in enumerate(zip(fresh_prompts(prompts), out_lens)):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            eng.add_request(f"busy{i}", p, params)
        start = time.perf_counter()
        while eng.has_unfinished:
            rows.append(len(eng.scheduler.running))
            eng.step()
            ends.append(time.perf_counter() - start)
        busy = meter.gpu_ms_by_step() if gpu else [None] * meter.steps
    walls = [1e3 * (b - a) for a, b in zip([0.0, *ends], ends)]
    return {"rows": rows, "wall_ms": walls, "gpu_ms": busy[: len(rows)], **meter.summary()}


BUCKETS = (1, 10, 25, 50, 100, 150, 200, 250)


def bucket_of(rows: int) -> int:
    return max(b for b in BUCKETS if b <= max(rows, 1))


def by_rows(
    timeline, cfg: dict, prompts, out_lens, copy_bw: float, matmul_flops: float, busy=None
) -> dict:
    """The run against the roofline step by step (module docstring): {"prefill": {...},
    "decode": [{rows, steps, wall_ms, roof_ms[, gpu_ms, busy_steps]} by bucket]}."""
    from benchmarks.roofline import model_sizes

    weight_bytes, kv_token, matmul_params = model_sizes(cfg)
    lens = [len(p) for p in prompts]
    roof: dict[int, list[float]] = {}
    for t in range(max(out_lens)):
        live = [n + t for n, o in zip(lens, out_lens) if o > t]
        roof.setdefault(bucket_of(len(live)), []).append(
            1e3 * (weight_bytes + kv_token * sum(live)) / copy_bw
        )
    # the prefill phase: the steps before the first that computes no more tokens than it
    # had rows (pure decode)
    done = [0] + [entry[2] for entry in timeline]
    running = [0] + [entry[3] for entry in timeline]
    prefill_steps = (
        next(
            (i for i in range(1, len(done)) if done[i] - done[i - 1] <= running[i - 1]),
            len(timeline) + 1,
        )
        - 1
    )
    prefill_s = timeline[prefill_steps - 1][0] if prefill_steps else 0.0
    walls: dict[int, list[float]] = {}
    decode_steps = zip(timeline[max(prefill_steps - 1, 0) :], timeline[max(prefill_steps, 1) :])
    for (t0, *_, rows), (t1, *_) in decode_steps:
        walls.setdefault(bucket_of(rows), []).append(1e3 * (t1 - t0))
    gpu: dict[int, list[float]] = {}
    if busy and busy.get("gpu_ms") and busy["gpu_ms"][0] is not None:
        for running, ms in zip(busy["rows"], busy["gpu_ms"]):
            if ms is not None:
                gpu.setdefault(bucket_of(running), []).append(ms)
    mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
    decode = []
    for b in BUCKETS:
        if b not in walls and b not in roof:
            continue
        row = {"rows": b, "steps": len(walls.get(b, [])), "wall_ms": mean(walls.get(b, []))}
        row.update(roof_steps=len(roof.get(b, [])), roof_ms=mean(roof.get(b, [])))
        if gpu:
            row.update(gpu_ms=mean(gpu.get(b, [])), busy_steps=len(gpu.get(b, [])))
        decode.append(row)
    prefill_roof_s = sum(2 * matmul_params * n for n in lens) / matmul_flops
    return {
        "prefill": {
            "steps": prefill_steps,
            "wall_s": round(prefill_s, 4),
            "roof_s": round(prefill_roof_s, 4),
        },
        "decode": decode,
    }


def rows_lines(table: dict) -> list[str]:
    """by_rows as text lines."""
    pre = table["prefill"]
    lines = [
        f"prefill phase: {pre['steps']} steps, {pre['wall_s']:.3f} s (roofline {pre['roof_s']:.3f} s)",
        "decode rows  steps  wall ms/step  roofline ms/step  GPU busy ms/step",
    ]
    for row in table["decode"]:
        cells = [f"{row['rows']:>5}+", f"{row['steps']:>6}"]
        for key in ("wall_ms", "roof_ms", "gpu_ms"):
            value = row.get(key)
            cells.append(f"{value:>12.3f}" if value is not None else f"{'-':>12}")
        lines.append("  ".join(cells))
    return lines


SAMPLING = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "top_k": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "penalty": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1},
}


def run_sampling(ckpt, prompts, out_lens, args) -> dict:
    """The workload greedy, then under each asked SAMPLING configuration, in one engine
    (a seed per request): {name: {wall_s, output_tokens, tok_s, ratio_to_greedy}}."""
    llm = _warm_llm(ckpt, prompts, args)
    names = ["greedy"] + (list(SAMPLING)[1:] if args.sampling == "all" else [args.sampling])
    return sampled_runs(llm, prompts, out_lens, names, args.device)


def sampled_runs(llm, prompts, out_lens, names, device) -> dict:
    """The requests run on the warmed-up `llm` once per SAMPLING name, greedy first,
    each timed alone after an untimed warm-up of its own configuration (four prompts,
    reversed, eight tokens: the decode graphs that sample inside them are captured
    there, as greedy's are in the LLM's warm-up): {name: {wall_s, output_tokens, tok_s,
    ratio_to_greedy}}. Each run's prompts start with their own first token, so no run
    takes pages from the prefix cache an earlier one left."""
    from batchgen import SamplingParams

    warm = [p[::-1] for p in prompts[:4]]
    results: dict[str, dict] = {}
    for k, name in enumerate(dict.fromkeys(names)):
        if name != "greedy":
            params = SamplingParams(max_tokens=8, ignore_eos=True, seed=0, **SAMPLING[name])
            llm.generate(warm, params, use_tqdm=False)
        results[name] = timed_pass(llm, prompts, out_lens, name, k + 1, device)
        results[name]["ratio_to_greedy"] = results[name]["tok_s"] / results["greedy"]["tok_s"]
    return results


def timed_pass(llm, prompts, out_lens, name: str, first_token: int, device) -> dict:
    """The requests once on the warmed-up `llm` under SAMPLING[name] (a seed per request,
    ignore_eos), each prompt's first token replaced by first_token (a pass of its own
    first token takes no page from the prefix cache another pass left), timed from the
    first add to the last step: {wall_s, output_tokens, tok_s}."""
    from batchgen import SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    eng = llm.engine
    sync(device)
    out0 = eng.stats.output_tokens
    with fewer_full_collections():
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            params = SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **SAMPLING[name])
            eng.add_request(f"{name}{first_token}-{i}", [first_token, *p[1:]], params)
        while eng.has_unfinished:
            eng.step()
    sync(device)
    wall = time.perf_counter() - start
    out = eng.stats.output_tokens - out0
    return {"wall_s": wall, "output_tokens": out, "tok_s": out / wall}


def print_sampling(runs: dict) -> None:
    for name, run in runs.items():
        sys.stdout.write(
            f"{name:<8} {run['tok_s']:10.1f} output tok/s  ({run['wall_s']:.2f} s)  "
            f"{run['ratio_to_greedy']:.2f}x greedy\n"
        )


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
        "--busy", action="store_true", help="run again with the GPU's busy time a step, by rows"
    )
    ap.add_argument(
        "--sampling",
        choices=sorted(SAMPLING) + ["all"],
        default=None,
        help="batchgen greedy, then sampled as named (all: every one), ratios to greedy",
    )
    ap.add_argument(
        "--constant-ceilings",
        action="store_true",
        help="take the roofline at the H200's constants instead of this card's measured ceilings",
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
        print_sampling(runs)
        return 0
    sizes = dict(copy_gib=1 / 64, matmul=256) if args.small else {}  # small: well under 1 s
    card = card_ceilings(args.device, measured=not args.constant_ceilings, **sizes)
    ours, timeline = run_batchgen(ckpt, prompts, out_lens, args)
    peer = None if args.skip_peer else continuous_batching(ckpt, prompts, out_lens, args)
    prompt_lens = [len(p) for p in prompts]
    roof = roofline_seconds(
        cfg,
        prompt_lens,
        out_lens,
        copy_bw=card["copy_bytes_per_s"],
        matmul_flops=card["matmul_flops"],
    )
    result = {
        "workload": "small" if args.small else "W1",
        "batchgen": ours,
        "peer": peer,
        "ceilings": card,
        "roofline_s": roof,
        "roofline_tok_s": sum(out_lens) / roof,
        "fraction_of_roofline": roof / ours["wall_s"],
        "fraction_at_h200_constants": roofline_seconds(cfg, prompt_lens, out_lens) / ours["wall_s"],
        "by_rows": by_rows(
            timeline,
            cfg,
            prompts,
            out_lens,
            card["copy_bytes_per_s"],
            card["matmul_flops"],
            ours.get("busy"),
        ),
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
        f"{100 * result['fraction_of_roofline']:.1f}% ({card['source']}: "
        f"{card['copy_bytes_per_s'] / 1e12:.2f} TB/s copy, "
        f"{card['matmul_flops'] / 1e12:.0f} TFLOP/s; at the H200's constants "
        f"{100 * result['fraction_at_h200_constants']:.1f}%)",
    ]
    if peer:
        lines.append(
            f"transformers {peer['tok_s']:9.1f} output tok/s  ({peer['wall_s']:.2f} s)"
            f"  -> ratio {result['ratio']:.1f}x"
        )
    lines += rows_lines(result["by_rows"])
    if args.profile:
        lines.append(json.dumps(ours["profile"], indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
