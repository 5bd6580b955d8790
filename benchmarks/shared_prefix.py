"""W3 `shared-prefix`: few-shot evaluation shape, host prefix hits on vs off.

    python benchmarks/shared_prefix.py            # W3 on the GPU: 4 GiB device KV, 64 GiB host
    python benchmarks/shared_prefix.py --small    # CPU, seconds, for CI

W1's model (random bf16 weights), 2048 requests from workloads.w3_requests(): 64
prefixes of 3,000 random tokens x 32 questions of 100, 16 output tokens each (greedy,
ignore_eos). The requests go round-robin over the prefixes (question q of every prefix
before question q + 1 of any): each prefix returns only after the 63 others, while the
4 GiB device pool holds about 12 requests' worth of pages, so every prefix is evicted
from the device before its next use when requests are admitted in arrival order (the
default here, --admission arrival). Grouped by prefix instead (--admission prefix, the
engine's default), an evicted prefix is rarely wanted again and the host tier hardly
matters: the host-tier checks below apply to arrival order only.

Two engines in one process, one after the other (the first freed before the second is
built), both with the device prefix cache on: host tier on (pages written through to a
64 GiB host pool come back as host prefix hits) and off (host_kv_size_gib=0: an evicted
prefix is computed again). Prints output tok/s and the prefill tokens computed in each
(all computed tokens but one decode token per output after a request's first), the
device and host prefix hits and the host->device traffic. Writes shared_prefix.json into
--out; exits 1 when a run lost output tokens or, in arrival order, the tier-on run had
no host prefix hit or did not compute fewer prefill tokens than the tier-off run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_runs import add_engine_args, checks_line, size, timed_run  # noqa: E402
from engine_runs import engine_kwargs as common_engine_kwargs  # noqa: E402
from workloads import QWEN3_0_6B, SMALL_MODEL, random_checkpoint, w3_requests  # noqa: E402


def small_workload() -> tuple[list[list[int]], list[int]]:
    """W3 scaled to the CPU: 8 prefixes of 96 tokens (6 pages) x 4 questions of 8 tokens,
    4 output tokens each; with a 16-page device pool about two prefixes fit at a time."""
    return w3_requests(
        num_prefixes=8, num_questions=4, prefix_len=96, question_len=8, out_len=4, max_token=500
    )


def engine_kwargs(args) -> dict:
    kw = common_engine_kwargs(args)
    if args.small:
        return dict(kw, device="cpu", dtype="float32", max_model_len=96 + 8 + 4, num_kv_pages=16)
    return dict(
        kw, device="cuda", dtype="bfloat16", max_model_len=3100 + 16, kv_cache_size_gib=args.kv_gib
    )


def summary(result: dict) -> str:
    on, off = result["host_hits_on"], result["host_hits_off"]
    lines = [
        f"{result['workload']}: {result['requests']} requests ({result['prefixes']} prefixes x "
        f"{result['questions']} questions, round-robin), {result['prompt_tokens']:,} prompt + "
        f"{result['expected_output_tokens']:,} output tokens",
    ]
    for label, run in (("host prefix hits on ", on), ("host prefix hits off", off)):
        m = run["metrics"]
        lines.append(
            f"{label} {run['tok_s']:10.1f} output tok/s ({run['wall_s']:.2f} s)  prefill "
            f"computed {m['prefill_tokens_computed']:,}  device hits {m['prefix_hit_tokens']:,}"
            f"  host hits {m.get('host_prefix_hit_tokens', 0):,} tokens  preemptions "
            f"{m['preemptions']}"
        )
    m = on["metrics"]
    lines += [
        f"prefill computed off/on {result['prefill_ratio']:.2f}x, output tok/s on/off "
        f"{result['ratio']:.2f}x",
        f"tier copies: {size(m['bytes_loaded'])} host->device, {size(m['bytes_offloaded'])} "
        f"device->host, {m['copy_gb_per_s']:.1f} GB/s over {m['copy_seconds']:.2f} s of "
        "copy-stream time",
        checks_line(result["checks"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and workload on the CPU")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="device KV pool (GiB)")
    ap.add_argument("--host-gib", type=float, default=64.0, help="host KV pool of the tier-on run")
    add_engine_args(ap)
    ap.set_defaults(admission="arrival")
    args = ap.parse_args(argv)
    if args.small:
        cfg, (prompts, out_lens) = SMALL_MODEL, small_workload()
        args.ckpt = args.ckpt.with_name(args.ckpt.name + "-small")
        args.host_gib, warmup_len, prefixes, questions = 0.002, 16, 8, 4
    else:
        cfg, (prompts, out_lens) = QWEN3_0_6B, w3_requests()
        warmup_len, prefixes, questions = 512, 64, 32
    ckpt = random_checkpoint(args.ckpt, cfg)
    kw = engine_kwargs(args)
    on = timed_run(ckpt, prompts, out_lens, warmup_len, host_kv_size_gib=args.host_gib, **kw)
    off = timed_run(ckpt, prompts, out_lens, warmup_len, host_kv_size_gib=0.0, **kw)
    prefill_on = on["metrics"]["prefill_tokens_computed"]
    prefill_off = off["metrics"]["prefill_tokens_computed"]
    result = {
        "workload": "small" if args.small else "W3",
        "requests": len(prompts),
        "prefixes": prefixes,
        "questions": questions,
        "order": "round-robin over prefixes: request k is question k // prefixes of prefix "
        "k % prefixes",
        "prompt_tokens": sum(len(p) for p in prompts),
        "expected_output_tokens": sum(out_lens),
        "engine": dict(kw, host_kv_size_gib=args.host_gib),
        "host_hits_on": on,
        "host_hits_off": off,
        "ratio": on["tok_s"] / off["tok_s"],
        "prefill_ratio": prefill_off / max(prefill_on, 1),
        "checks": {
            "all_outputs": on["all_outputs"] and off["all_outputs"],
            "same_output_tokens": on["output_tokens"] == off["output_tokens"] == sum(out_lens),
        },
    }
    if args.admission == "arrival":
        result["checks"]["host_prefix_hits"] = on["metrics"]["host_prefix_hit_pages"] > 0
        result["checks"]["fewer_prefill_tokens"] = prefill_on < prefill_off
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prefix.json").write_text(json.dumps(result, indent=2))
    sys.stdout.write(summary(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
