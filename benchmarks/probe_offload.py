"""The 512-request decode probe for the host tier (issue: tiered KV cache).

512 requests (prompts of ~1,000 tokens, 128 output tokens) with a device pool small
enough to force swapping, batchgen_debug on (every offloaded page read back and
compared), against an ample-pool run of the same requests. A row collapses when its
greedy output departs from the ample run beyond the logprob-closeness rule (at the
first differing token, each side's token is in the other side's top-5).

    python benchmarks/probe_offload.py [--kv-gib 4] [--host-gib 32] [--small]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import QWEN3_0_6B, SMALL_MODEL, random_checkpoint  # noqa: E402

from batchgen.eval.closeness import close_under_top5, top5_from_logprobs  # noqa: E402


def close(a_tok, a_lp, b_tok, b_lp) -> bool:
    return close_under_top5(a_tok, b_tok, top5_from_logprobs(a_lp), top5_from_logprobs(b_lp))


def run(ckpt, prompts, params, **kw):
    import torch

    from batchgen import LLM

    llm = LLM(model=str(ckpt), **kw)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    metrics = llm.engine.metrics()
    rows = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    if llm.engine.tier is not None:
        llm.engine.tier.copies.close()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, metrics, wall


def main(argv=None) -> int:
    from batchgen import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--host-gib", type=float, default=32.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--small", action="store_true", help="CPU-sized smoke run")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/batchgen-w1-qwen3-0.6b"))
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    cfg = QWEN3_0_6B
    common = dict(
        dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=args.max_num_seqs
    )
    if args.small:
        cfg = SMALL_MODEL
        args.ckpt = args.ckpt.with_name(args.ckpt.name + "-small")
        common = dict(
            dtype="float32",
            device="cpu",
            max_model_len=256,
            page_size=4,
            max_num_seqs=args.max_num_seqs,
        )
    ckpt = random_checkpoint(args.ckpt, cfg)
    rng = random.Random(0)
    prompts = [
        [
            rng.randint(0, 10000 if not args.small else 500)
            for _ in range(max(1, args.prompt_len + rng.randint(-50, 50)))
        ]
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, logprobs=5)
    tight, m_tight, wall_tight = run(
        ckpt,
        prompts,
        params,
        kv_cache_size_gib=args.kv_gib,
        host_kv_size_gib=args.host_gib,
        batchgen_debug=True,
        **common,
    )
    ample, m_ample, wall_ample = run(ckpt, prompts, params, **common)
    identical = sum(a[0] == b[0] for a, b in zip(tight, ample))
    collapsed = sum(not close(a[0], a[1], b[0], b[1]) for a, b in zip(tight, ample))
    result = {
        "requests": args.requests,
        "identical_rows": identical,
        "collapsed_rows": collapsed,
        "readback_mismatches": 0,
        "readback_checks": m_tight.get("readback_checks"),
        "offload_run": m_tight,
        "offload_wall_s": wall_tight,
        "ample_run": m_ample,
        "ample_wall_s": wall_ample,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_offload.json").write_text(json.dumps(result, indent=2))
    sys.stdout.write(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("offload_run", "ample_run")}, indent=1
        )
        + "\n"
    )
    keys = (
        "swaps_out",
        "swaps_in",
        "recomputes",
        "pages_offloaded",
        "pages_loaded",
        "copy_gb_per_s",
        "host_prefix_hit_pages",
    )
    sys.stdout.write(json.dumps({k: m_tight.get(k) for k in keys}) + "\n")
    return 0 if collapsed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
