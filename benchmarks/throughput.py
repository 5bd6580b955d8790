"""W1 `nano`: batchgen vs transformers' continuous batching (paged|sdpa) in one run.

    python benchmarks/throughput.py                 # W1 on the GPU, peer beside it
    python benchmarks/throughput.py --skip-peer     # while iterating (not a result)
    python benchmarks/throughput.py --small         # CPU, seconds, for CI
    python benchmarks/throughput.py --profile       # + where a decode step's time goes

Prints output tok/s for both, their ratio and batchgen's fraction of the roofline
(roofline.py); writes throughput.json and throughput.png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from roofline import roofline_seconds  # noqa: E402
from workloads import (  # noqa: E402
    QWEN3_0_6B,
    SMALL_MODEL,
    random_checkpoint,
    small_requests,
    w1_requests,
)


def run_batchgen(ckpt, prompts, out_lens, args):
    from batchgen import LLM, SamplingParams

    llm = LLM(
        model=str(ckpt),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        attention_backend=args.backend,
        max_model_len=2048,
        enforce_eager=args.eager,
    )
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    eng = llm.engine
    _sync(args.device)
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        eng.add_request(f"w{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    timeline = []
    while eng.has_unfinished:
        eng.step()
        timeline.append((time.perf_counter() - start, eng.stats.output_tokens))
    _sync(args.device)
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
    }
    if args.profile:
        result["profile"] = profile_decode(llm, prompts, args)
    return result, timeline


def profile_decode(llm, prompts, args):
    """Where a decode step's time goes: GPU time by kernel family, host time by phase."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from batchgen import SamplingParams

    eng = llm.engine
    for i, p in enumerate(prompts[: args.max_num_seqs]):
        eng.add_request(f"prof{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(200):  # every prompt prefilled: profile pure decode steps
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.requests.values()):
            break
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
    steps = 16
    _sync(args.device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        _sync(args.device)
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    eng.abort(list(eng.requests))
    families = {
        "attention": (
            "attn",
            "attention",
            "flash",
            "einsum",
            "bmm",
            "softmax",
            "decode",
            "prefill",
        ),
        "gemm": ("gemm", "cutlass", "sm90", "matmul", "addmm", "linear", "nvjet"),
        "sampling": ("exponential", "argmax", "sort", "topk", "log_softmax"),
        "kv_write": ("index_copy", "store_kv", "index_put"),
    }
    gpu = {k: 0.0 for k in families} | {"other": 0.0}
    host = {}
    for e in prof.key_averages():
        name = e.key.lower()
        dev_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if dev_us:
            fam = next((k for k, pats in families.items() if any(p in name for p in pats)), "other")
            gpu[fam] += dev_us / 1000 / steps
        if e.key.startswith("batchgen."):
            host[e.key] = e.cpu_time_total / 1000 / steps
    del torch
    return {"step_wall_ms": wall_ms, "gpu_ms_by_family": gpu, "host_ms_by_phase": host}


def run_peer(ckpt, prompts, out_lens, args):
    """transformers' continuous batching with paged|sdpa, per-request max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).to(args.device)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(out_lens), eos_token_id=None, pad_token_id=0
    )
    mgr = model.init_continuous_batching(generation_config=gen)
    mgr.start()
    _sync(args.device)
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    got = 0
    for _ in prompts:
        res = mgr.get_result(timeout=600)
        if res is None:
            break
        got += len(res.generated_tokens)
    wall = time.perf_counter() - start
    mgr.stop()
    return {"wall_s": wall, "output_tokens": got, "tok_s": got / wall}


def _sync(device):
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def plot(timeline, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ts = [t for t, _ in timeline]
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
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/batchgen-w1-qwen3-0.6b"))
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    if args.small:
        cfg, (prompts, out_lens) = SMALL_MODEL, small_requests()
        args.device, args.dtype = "cpu", "float32"
        args.ckpt = args.ckpt.with_name(args.ckpt.name + "-small")
    else:
        cfg, (prompts, out_lens) = QWEN3_0_6B, w1_requests()
        args.device, args.dtype = "cuda", "bfloat16"
    ckpt = random_checkpoint(args.ckpt, cfg)
    ours, timeline = run_batchgen(ckpt, prompts, out_lens, args)
    peer = None if args.skip_peer else run_peer(ckpt, prompts, out_lens, args)
    roof = roofline_seconds(cfg, [len(p) for p in prompts], out_lens)
    result = {
        "workload": "small" if args.small else "W1",
        "batchgen": ours,
        "peer": peer,
        "roofline_s": roof,
        "roofline_tok_s": sum(out_lens) / roof,
        "fraction_of_roofline": roof / ours["wall_s"],
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
        f"{100 * result['fraction_of_roofline']:.1f}%",
    ]
    if peer:
        lines.append(
            f"transformers {peer['tok_s']:9.1f} output tok/s  ({peer['wall_s']:.2f} s)"
            f"  -> ratio {result['ratio']:.1f}x"
        )
    if args.profile:
        lines.append(json.dumps(ours["profile"], indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
