"""W4 `mla`: a DeepSeek-V3-architecture model (MLA + MoE) against transformers, host tier on.

    PYTHONPATH=src python3 -m benchmarks.mla --out $OUT               # W4 on the GPU, peer beside it
    PYTHONPATH=src python3 -m benchmarks.mla --peer-batches 1 --out $OUT  # peer on 1 batch
    PYTHONPATH=src python3 -m benchmarks.mla --skip-peer --out $OUT   # while iterating
    PYTHONPATH=src python3 -m benchmarks.mla --skip-peer --profile --out $OUT  # + decode step
    PYTHONPATH=src python3 -m benchmarks.mla --skip-peer --profile-prefill --out $OUT  # + prefill
    PYTHONPATH=src python3 -m benchmarks.mla --small --out /tmp/w4    # CPU, seconds, for CI
    PYTHONPATH=src python3 -m benchmarks.mla --sampling all --out $OUT  # sampled beside greedy

Model: workloads.MOONLIGHT_W4, a scaled Moonlight-16B-A3B-like config (27 layers, hidden
2048, MLA with kv_lora_rank 512 and a 64-wide rope part, 16 heads, 64 routed experts top-6
plus 2 shared, first layer dense), random bf16 weights. batchgen draws them on the device
from config.json alone (load_format="dummy"); the peer, transformers' DeepseekV3 through
`generate()` in padded batches of 64 (its continuous batching assumes K and V of one head
size), gets its own random weights of the same shapes: throughput does not depend on the
values, and greedy decoding with ignore_eos makes both produce exactly the output lengths.

Workload: workloads.w4_requests(), 512 prompts of 1024 random tokens, 128 output tokens
each, greedy, ignore_eos; batchgen in its defaults (CUDA graphs, pipelined decode, prefix
admission) with the host tier on (--host-gib, 32). Prints output tok/s of both, their
ratio and the fraction of the roofline (BENCHMARKS.md: ~13,350 tok/s), and a breakdown of
batchgen's run: prefill and decode phases (the prefill phase ends once every request has
its first token), tier traffic. Writes mla.json into --out.

--sampling greedy|sampled|top_k|penalty|all: batchgen alone (no peer), one engine, W4's
requests greedy and then sampled as throughput.py's SAMPLING names them (issue 49: each
beside greedy on W4's model as on W1's); prints each run's output tok/s and its ratio to
greedy, writes sampling.json.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.moe_runs import (
    add_workload_args,
    batchgen_line,
    peer_line,
    print_run,
    release_device_memory,
    run_batchgen,
    run_lines,
    w4_workload,
    warm_up,
    workload_llm,
)
from benchmarks.peers import padded_generate
from benchmarks.throughput import SAMPLING, print_sampling, sampled_runs
from benchmarks.workloads import MOONLIGHT_W4, SMALL_MOONLIGHT

ROOFLINE_TOK_S = 13_350  # BENCHMARKS.md W4, H200


def run_sampling(ckpt, prompts, out_lens, args) -> dict:
    """W4's requests greedy, then sampled as --sampling names, in one engine built and
    warmed up as `moe_runs.run_batchgen` builds its own (throughput.sampled_runs)."""
    llm = workload_llm(ckpt, prompts, out_lens, args)
    warm_up(llm, prompts)
    names = ["greedy"] + (list(SAMPLING)[1:] if args.sampling == "all" else [args.sampling])
    return sampled_runs(llm, prompts, out_lens, names, args.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(
        ap,
        peer_batches=0,
        peer_help="batches of 64 the peer is timed on, after an untimed warm-up (0, the "
        "default: all 8, timed from the first; the full run takes about 3 minutes)",
    )
    ap.add_argument(
        "--sampling",
        choices=sorted(SAMPLING) + ["all"],
        default=None,
        help="batchgen greedy, then sampled as named (all: every one), ratios to greedy",
    )
    args = ap.parse_args(argv)
    prompts, out_lens, ckpt = w4_workload(args, MOONLIGHT_W4, SMALL_MOONLIGHT, "w4", 24)
    if args.sampling:
        runs = run_sampling(ckpt, prompts, out_lens, args)
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"workload": "small" if args.small else "W4", "sampling": runs}
        (args.out / "sampling.json").write_text(json.dumps(result, indent=2))
        print_sampling(runs)
        return 0
    ours = run_batchgen(ckpt, prompts, out_lens, args)
    release_device_memory()
    print(json.dumps({"batchgen": ours}), flush=True)
    peer = None
    if not args.skip_peer:
        batches = None if args.small or not args.peer_batches else args.peer_batches
        peer = padded_generate(ckpt, prompts, out_lens, args, batches)
    result = {"workload": "small" if args.small else "W4", "batchgen": ours, "peer": peer}
    if not args.small:
        result["fraction_of_roofline"] = ours["tok_s"] / ROOFLINE_TOK_S
    if peer:
        result["ratio"] = ours["tok_s"] / peer["tok_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla.json").write_text(json.dumps(result, indent=2))
    lines = [
        batchgen_line(ours),
        *run_lines(ours),
    ]
    if "fraction_of_roofline" in result:
        lines.append(
            f"roofline     {ROOFLINE_TOK_S:10.1f} -> {100 * result['fraction_of_roofline']:.1f}%"
        )
    if peer:
        lines.append(peer_line(peer, result["ratio"]))
    return print_run(lines, ours, out_lens)


if __name__ == "__main__":
    sys.exit(main())
