"""Batch invariance (issue 50): deterministic=True against itself batched other ways, and
what it costs.

The 512-request probe (prompts of ~1,000 random tokens, up to 128 output tokens; every
other row greedy, the rest sampled with a seed of their own), every run deterministic=True
with every other default on (CUDA graphs, pipelined decode, prefix caching, the host tier
where given), each against the `ample` run (ample pool, --max-num-seqs):

- batched:     the ample pool, --other-seqs rows a step (it batches its own way)
- tier:        a small device pool (--kv-gib; --small: --kv-pages) and the host tier,
               tier_policy "always": requests swapped out and back
- reconfigure: the ample pool and the host tier, reconfigure() every --swap-every steps
               (every running request preempted: swapped or recomputed)

A row differs when any token or its finish reason does; the goal is 0 of 512 in every
run. `cost`: output tok/s of the ample run against the same run with deterministic=False,
in the same process (the W1, W4 and W6 shapes: --model qwen3-0.6b, moonlight-w4,
kimi-w6). --runs picks the runs (default: all); each GPU run here keeps under ~4 min:

    PYTHONPATH=src python3 -m benchmarks invariance --out $OUT              # W1's shape
    PYTHONPATH=src python3 -m benchmarks invariance --model moonlight-w4 --out $OUT
    PYTHONPATH=src python3 -m benchmarks invariance --model kimi-w6 --kv-gib 1 --out $OUT
    PYTHONPATH=src python3 -m benchmarks invariance --model default --out $OUT  # needs the GGUF
    PYTHONPATH=src python3 -m benchmarks invariance --small --out /tmp/inv      # CPU, seconds

--model: a workloads.MODELS name (random bf16 weights, load_format="dummy"), "default"
(batchgen's embedded model; its GGUF must be in the cache: no network on the device) or a
path. Writes invariance.json into --out; exits 1 when a row differs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from benchmarks.engine_runs import threads_for
from benchmarks.probe_offload import make_prompts, reconfiguring, resolve_model

RUNS = ("batched", "tier", "reconfigure", "cost")


def request_params(n: int, output_len: int, greedy_only: bool) -> list:
    """Every other row greedy, the rest sampled (temperature 0.8, top_p 0.9) with the
    row's index as its seed."""
    from batchgen import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=output_len)
        if greedy_only or i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=output_len)
        for i in range(n)
    ]


def generate(model, prompts, params, every: int = 0, **kw) -> tuple[list, dict, float]:
    """Rows of (token ids, finish reason) from a fresh engine, its metrics and the wall
    seconds of generating; every > 0: driven step by step, reconfigure() re-creating the
    pool at its size every `every` steps (counted as "reconfigures")."""
    import torch

    from batchgen import LLM, SamplingParams

    with threads_for(kw["device"]):
        llm = LLM(model=model, **kw)
        eng = llm.engine
        # kernels compiled and decode graphs captured before the clock starts (prompts of
        # their own: no prefix of the probe's is cached)
        warm = [[(7 * i + j) % 97 + 3 for j in range(len(prompts[0]))] for i in range(2)]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        start = time.perf_counter()
        if every:
            rows, extra = _reconfiguring(eng, prompts, params, every)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            rows = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
            extra = {}
        wall = time.perf_counter() - start
        metrics = eng.metrics() | extra
        if eng.tier is not None:
            eng.tier.copies.close()
        eng.shutdown()
        del llm, eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, metrics, wall


def _reconfiguring(eng, prompts, params, every: int) -> tuple[list, dict]:
    reqs, reconfigures = reconfiguring(eng, prompts, params, every, "inv")
    rows = [(list(r.output_token_ids), r.finish_reason) for r in reqs]
    preempted = sum(1 for r in reqs if r.num_preemptions)
    return rows, {"reconfigures": reconfigures, "requests_preempted": preempted}


def differing(rows, ample, params) -> dict:
    """Rows whose tokens or finish reason differ from the ample run's, greedy and sampled
    apart, with the first few rows and where each departs."""
    diff = [i for i, (a, b) in enumerate(zip(rows, ample, strict=True)) if a != b]
    greedy = sum(params[i].temperature == 0 for i in diff)
    where = []
    for i in diff[:20]:
        a, b = rows[i][0], ample[i][0]
        where.append(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {
        "rows_differing": len(diff),
        "greedy_differing": greedy,
        "sampled_differing": len(diff) - greedy,
        "rows": diff[:20],
        "first_difference": where,
    }


def tokens_per_s(rows, wall: float) -> float:
    return round(sum(len(t) for t, _ in rows) / wall, 1)


# the counters a run reports beside its verdict (engine metrics, and the reconfigure run's)
KEPT = (
    "swaps_out",
    "swaps_in",
    "recomputes",
    "preemptions",
    "prefix_hit_tokens",
    "reconfigures",
    "requests_preempted",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a workloads name, 'default' or a path")
    ap.add_argument("--requests", type=int, default=None, help="512 (--small: 16)")
    ap.add_argument("--prompt-len", type=int, default=None, help="1000 (--small: 48)")
    ap.add_argument("--output-len", type=int, default=None, help="128 (--small: 16)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the ample run's")
    ap.add_argument(
        "--other-seqs", type=int, default=None, help="batched run's (3/8 of the ample run's rows)"
    )
    ap.add_argument("--kv-gib", type=float, default=4.0, help="tier run's device KV pool")
    ap.add_argument("--kv-pages", type=int, default=40, help="--small: tier run's pool pages")
    ap.add_argument("--host-gib", type=float, default=None, help="32 (--small: 0.002)")
    ap.add_argument("--swap-every", type=int, default=None, help="64 (--small: 4) steps")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"some of {','.join(RUNS)}")
    ap.add_argument("--greedy-only", action="store_true", help="no sampled rows")
    ap.add_argument("--backend", default="auto", help="attention_backend")
    ap.add_argument("--small", action="store_true", help="CPU-sized run (tiny config)")
    ap.add_argument("--ckpt", type=Path, default=None, help="directory for --model's config")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or set(runs) - set(RUNS):
        ap.error(f"--runs takes some of {','.join(RUNS)}, got {args.runs!r}")
    small = dict(requests=16, prompt_len=48, output_len=16, swap_every=4)
    full = dict(requests=512, prompt_len=1000, output_len=128, swap_every=64)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    other_seqs = args.other_seqs or max(1, min(args.max_num_seqs, args.requests) * 3 // 8)
    model, model_kw, max_token = resolve_model(args)
    prompts = make_prompts(args.requests, args.prompt_len, max_token)
    params = request_params(args.requests, args.output_len, args.greedy_only)
    common = dict(model_kw, attention_backend=args.backend, deterministic=True)
    if args.small:
        longest = args.prompt_len + min(50, args.prompt_len // 4) + args.output_len
        common.update(dtype="float32", device="cpu", max_model_len=max(96, longest), page_size=4)
        host = dict(host_kv_size_gib=0.002 if args.host_gib is None else args.host_gib)
        tight = dict(host, num_kv_pages=args.kv_pages)
    else:
        common.update(dtype="bfloat16" if model_kw else "auto", device="cuda", max_model_len=2048)
        host = dict(host_kv_size_gib=32.0 if args.host_gib is None else args.host_gib)
        tight = dict(host, kv_cache_size_gib=args.kv_gib)
    ample_kw = dict(common, max_num_seqs=args.max_num_seqs)

    ample, m_ample, wall = generate(model, prompts, params, **ample_kw)
    result = {
        "model": model or "batchgen default model",
        "requests": args.requests,
        "engine": ample_kw,
        "ample": {"tok_per_s": tokens_per_s(ample, wall), "wall_s": round(wall, 2)},
    }
    others = {
        "batched": (dict(common, max_num_seqs=other_seqs), 0),
        "tier": (dict(ample_kw, **tight, tier_policy="always"), 0),
        "reconfigure": (dict(ample_kw, **host), args.swap_every),
    }
    for name in [r for r in runs if r in others]:
        kw, every = others[name]
        rows, metrics, wall = generate(model, prompts, params, every, **kw)
        kept = {k: v for k, v in metrics.items() if k in KEPT}
        result[name] = differing(rows, ample, params) | kept | {"wall_s": round(wall, 2)}
    if "batched" in result:
        result["batched"]["max_num_seqs"] = other_seqs
    if "cost" in runs:
        plain, _, wall = generate(model, prompts, params, **dict(ample_kw, deterministic=False))
        rate, det = tokens_per_s(plain, wall), result["ample"]["tok_per_s"]
        result["cost"] = {
            "deterministic_tok_per_s": det,
            "plain_tok_per_s": rate,
            "slowdown_pct": round(100 * (1 - det / rate), 1),
        }
    bad = sum(result[r]["rows_differing"] for r in runs if r in others)
    result["rows_differing_total"] = bad
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "invariance.json").write_text(json.dumps(result, indent=1))
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
