"""W6 `hybrid`: a Kimi-Linear-architecture model (KDA + MLA + MoE) against transformers.

    PYTHONPATH=src python3 -m benchmarks.hybrid --out $OUT               # W6 on the GPU, peer beside it
    PYTHONPATH=src python3 -m benchmarks.hybrid --skip-peer --out $OUT   # while iterating
    PYTHONPATH=src python3 -m benchmarks.hybrid --skip-peer --profile --profile-prefill --out $OUT
    PYTHONPATH=src python3 -m benchmarks.hybrid --skip-peer --step-phases --out $OUT  # host ms a step
    PYTHONPATH=src python3 -m benchmarks.hybrid --small --out /tmp/w6    # CPU, seconds, for CI

Model: workloads.KIMI_W6, a scaled Kimi-Linear-48B-A3B-like config (24 layers, every 4th
an MLA layer with kv_lora_rank 512, the rest KDA with 16 heads of 128 and a 4-tap short
convolution, hidden 2048, 64 routed experts top-6 plus 1 shared, first layer dense),
random bf16 weights drawn by batchgen on the device from config.json alone
(load_format="dummy"). The peer is transformers' Kimi Linear through `generate()` in
padded batches of 64 (timed on --peer-batches of the 8, after an untimed warm-up: the
first batch's prompts for two new tokens),
with its own random weights of the same shapes; it runs fla-core's
KDA kernels where fla-core is importable and its pure-torch KDA otherwise, and the result
says which ("peer_kda"). Where the installed transformers has no Kimi Linear, the peer is
skipped with the reason.

Workload: workloads.w4_requests() (the same shape as W4: 512 prompts of 1024 random
tokens, 128 output tokens each), greedy, ignore_eos; batchgen in its defaults with the
host tier on (--host-gib, 32). Prints output tok/s of both and their ratio, batchgen's
prefill and decode phases, and its counters (the tier's, state copies included where
they ran). Writes hybrid.json into --out. The run is the one mla.py makes
(moe_runs.run_batchgen and peers.padded_generate), on this model.

A machine's first process compiles and autotunes fla-core's kernels during the build
(untimed; about 4 minutes on a fresh H200 before the shipped table of
kernels/autotune_table.py). The engine keeps the autotuning on disk beside the compiled
kernels (unless TRITON_CACHE_AUTOTUNING is set), and a later process built in about 20 s;
`python -m benchmarks.startup --model kimi-w6 --device cuda` times this build alone.

The peer is host-bound (transformers' MoE loops over experts in Python), so its rate
follows the machine's CPU: 405-544 tok/s across H200 machines so far, each ratio against
the peer of its own run.
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
)
from benchmarks.peers import padded_generate, peer_kda_path, torch_kda_for_the_peer
from benchmarks.workloads import KIMI_W6, SMALL_KIMI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(
        ap,
        peer_batches=2,
        peer_help="batches of 64 the peer is timed on, after an untimed warm-up (2; 0: all, "
        "timed from the first). The full peer run takes longer than a device call allows.",
    )
    args = ap.parse_args(argv)
    prompts, out_lens, ckpt = w4_workload(args, KIMI_W6, SMALL_KIMI, "w6", 70)
    ours = run_batchgen(ckpt, prompts, out_lens, args)
    release_device_memory()
    print(json.dumps({"batchgen": ours}), flush=True)
    kda = peer_kda_path()
    peer = None
    if args.skip_peer:
        pass
    elif kda is None:
        peer = {"skipped": "this transformers has no Kimi Linear (transformers.models.kimi_linear)"}
    else:
        if args.small:
            torch_kda_for_the_peer()
        batches = None if args.small or not args.peer_batches else args.peer_batches
        peer = dict(
            padded_generate(ckpt, prompts, out_lens, args, batches), peer_kda=peer_kda_path()
        )
    result = {"workload": "small" if args.small else "W6", "batchgen": ours, "peer": peer}
    if peer and "tok_s" in peer:
        result["ratio"] = ours["tok_s"] / peer["tok_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid.json").write_text(json.dumps(result, indent=2))
    lines = [
        batchgen_line(ours, f", backend {ours['backend']}"),
        "counters     " + json.dumps(ours["counters"]),
        *run_lines(ours),
    ]
    if peer and "skipped" in peer:
        lines.append(f"transformers skipped: {peer['skipped']}")
    elif peer:
        lines.append(peer_line(peer, result["ratio"], f", KDA {peer['peer_kda']}"))
    return print_run(lines, ours, out_lens)


if __name__ == "__main__":
    sys.exit(main())
