"""The 512-request decode probe for the host tier (issue: tiered KV cache).

512 requests (prompts of ~1,000 random tokens, up to 128 output tokens, greedy) with a
device pool small enough to force preemption (4 GiB, --kv-gib) and a host tier (32 GiB,
--host-gib), against an ample-pool run of the same requests without the tier. A row is
broken when its output departs from the ample run's beyond the logprob-closeness rule
(batchgen/eval/closeness.py): identical (tokens, length and finish reason), or at the
first differing token each side's token is among the other side's five most likely; a
row that stops where the other goes on, or runs past an EOS, is broken.

On the GPU (from the repository root):

    # the default configuration, W1's model: ~1.5 min
    PYTHONPATH=src python3 -m benchmarks.probe_offload --out $OUT
    # the same, the tier made to swap whatever it costs (auto may choose to recompute)
    PYTHONPATH=src python3 -m benchmarks.probe_offload --tier-policy always --out $OUT
    # Llama-3.1-8B's architecture, random weights: ~2 min
    PYTHONPATH=src python3 -m benchmarks.probe_offload --model llama-3.1-8b --out $OUT
    # the debug probe (batchgen_debug read-back of every offloaded page): ~3 min
    PYTHONPATH=src python3 -m benchmarks.probe_offload --debug --out $OUT
    # CPU, seconds, for CI
    PYTHONPATH=src python3 -m benchmarks.probe_offload --small --out /tmp/probe

Default mode: the engine's default configuration (debug off, pipelined decode, CUDA
graphs, tier_policy and decode_append as given, default "auto" and "off"), requests that
end at EOS or max_tokens (no ignore_eos) and report no logprobs, so they run as a user's
would. The top-5 at a divergence comes from scoring afterwards: every non-identical row's
prompt plus the common part of both outputs runs once more, for one token with
logprobs=5, on the ample engine; both sides' tokens at the divergence must be in that
top-5 (both sides continue the same tokens there, so one top-5 stands for both). Ten are
scored, so each broken row's "broken_detail" gives both tokens' ranks and logprobs: a
near-tie among more than five tokens reads apart from a collapse.
--debug: the probe as first run (HISTORY.md, 2026-11-30): batchgen_debug=True on the tier
run (every offloaded page read back and compared), ignore_eos, logprobs=5 on every token
of both runs, each side's own top-5 at the divergence.

--readback: the default mode with batchgen_debug=True on the tier run (every offloaded
page, and a hybrid model's every offloaded state slot, read back and compared with its
device source; a mismatch raises and ends the probe), everything else as users run it.
This is the forced-offload probe of the W4 and W6 models:

    # W4's model (MLA latent pages), 4 GiB device pool: every default on, readback
    PYTHONPATH=src python3 -m benchmarks.probe_offload --model moonlight-w4 --readback --out $OUT
    # W6's model (KDA state slots + MLA pages): a 1 GiB pool forces swaps
    PYTHONPATH=src python3 -m benchmarks.probe_offload --model kimi-w6 --kv-gib 1 --readback --out $OUT

--tp N: both runs split over N tensor-parallel ranks (gloo on the CPU, NCCL on GPUs, decode
CUDA graphs on every rank as in the defaults; random weights are drawn per rank, so the
ample run splits the same way to hold the same ones); each worker's own swaps, loads and
readbacks are reported beside rank 0's (`worker_tiers`). The issue-15
probe at two ranks on the CPU, a tiny Kimi-Linear-shaped model, W6's request mix:

    python3 -m benchmarks.probe_offload --small --model kimi-w6 --tp 2 --readback \
        --requests 512 --prompt-len 1000 --output-len 128 --kv-pages 36000 --host-gib 0.5

The 8-GPU contract itself, on 8 GPUs (every request preempted every 16 steps, swapped):

    PYTHONPATH=src python3 -m benchmarks.probe_offload --model kimi-w6-x8 --tp 8 --readback \
        --tier-policy always --swap-every 16 --out $OUT

--swap-every STEPS (default modes): the tier run is driven step by step and every STEPS
steps reconfigure() re-creates its device pool at the same size, which preempts every
running request (swapped where the tier's policy and room allow, else recomputed): with
STEPS shorter than a request's life, every request is preempted at least once (printed:
"requests_preempted", beside "reconfigures"), what the 8-GPU contract's probe asks of a
small pool. It works under --tp too (every rank re-creates its pool).

--control (default modes): one more run with the ample pool and no tier at half
--max-num-seqs, judged against the ample run by the same rule ("control" in the output).
It changes only which requests share a step, so the numerics of each row's steps (kernel
choice by batch size, bf16 rounding): what batching alone does to the rows. In a model
with random weights whose routing flips on small differences (random-weight MoE in bf16)
the closeness rule can count rows broken with no tier at all; the control says how many,
and the tier run's copies are proven by the readback either way.

--replay (default modes): the tier run's launched steps are recorded and computed again
by an engine with the ample pool, no tier and no prefix caching, one step at a time
(schedule_replay.py): the same rows, tokens and shapes in every step, so only where the
KV lived between steps differs ("replay" in the output, judged by the same rule; it
decides the exit status). A correct tier gives identical rows however batching rounds:
the W4 and W6 models' probes on the GPU:

    PYTHONPATH=src python3 -m benchmarks.probe_offload --model moonlight-w4 --replay --out $OUT
    PYTHONPATH=src python3 -m benchmarks.probe_offload --model kimi-w6 --kv-gib 1 --replay --out $OUT

--dtype float32 (GPU): the same probe with batching's rounding far below any routing
margin, so that rows broken in bf16 by routing flips alone come out identical; the MoE
layers' grouped GEMM serves bfloat16 only, so decode then runs without CUDA graphs.

--model: qwen3-0.6b (W1's model, the default), llama-3.1-8b, moonlight-w4 (W4), kimi-w6
(W6) or kimi-w6-x8 (the 8-GPU contract's model, W6 scaled: workloads.KIMI_W6_X8) with
random bf16 weights
(load_format="dummy", the directory --ckpt or /tmp/batchgen-<model>-config holds only
config.json and a tokenizer); "default" for batchgen's embedded default model (needs
the gguf package); or the path of a model directory or GGUF file (its own weights).
Prints identical / close / broken rows, the tier run's swaps, recomputes and host
prefix hits, and its copies by reason with their GB/s of copy-stream time (`copies`: a
hybrid model's state slots as state_swap_out / state_swap_in); writes probe_offload.json
into --out; exits 1 when a row is broken.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

from batchgen.eval.closeness import (
    close_under_top5,
    ending_mismatch,
    first_difference,
    top5_from_logprobs,
)
from benchmarks.engine_runs import dummy_model, engine_default, threads_for
from benchmarks.schedule_replay import ReplayScheduler, StepRecorder, replay_params
from benchmarks.workloads import MODELS

# the tier run's counters worth a line (engine metrics() names)
TIER_KEYS = (
    "preemptions",
    "requests_preempted",
    "longest_output_never_preempted",
    "reconfigures",
    "swaps_out",
    "swaps_in",
    "state_swaps_out",
    "state_swaps_in",
    "recomputes",
    "host_prefix_hit_pages",
    "pages_offloaded",
    "pages_loaded",
    "copy_gb_per_s",
    "readback_checks",
    "tier_loads_pay",
    "tier_load_us_per_token",
    "tier_recompute_us_per_token",
)


def copy_rates(metrics: dict) -> dict:
    """The tier run's copies by why they moved (engine metrics' bytes_<reason> and
    copy_seconds_<reason>): bytes, copy-stream seconds and GB/s; a hybrid model's
    compressed-state slots as state_swap_out / state_swap_in."""
    out = {}
    for key, nbytes in sorted(metrics.items()):
        reason = key[len("bytes_") :]
        if key.startswith("bytes_") and nbytes and f"copy_seconds_{reason}" in metrics:
            secs = metrics[f"copy_seconds_{reason}"]
            rate = round(nbytes / secs / 1e9, 2) if secs > 0 else None
            out[reason] = {"bytes": nbytes, "seconds": round(secs, 4), "gb_per_s": rate}
    return out


def compare(prompts, tier_rows, ample_rows, score, eos_ids=()) -> dict:
    """Rows of (token ids, finish reason) under the closeness rule, endings included;
    eos_ids: the ids both runs end a row at (the EOS ids unless ignore_eos).
    score(prompts) -> the most likely next tokens after each prompt, as (token id,
    logprob) pairs best first (at least five); it is called once, with prompt + common
    output of every row whose tokens differ. A row whose endings alone break the rule (one
    stopped where the other went on, equal tokens with other finish reasons, a run past
    an EOS) is broken with its "ending" said. Each broken row is described in
    "broken_detail": where it departs, both tokens, their ranks in the scored list (None:
    below it) and the list itself, so a near-tie among more than five tokens tells
    itself apart from a collapse."""
    identical, broken, diverging, detail = [], [], [], []
    for i, ((a, fa), (b, fb)) in enumerate(zip(tier_rows, ample_rows, strict=True)):
        ending = ending_mismatch(a, b, fa, fb, eos_ids)
        if ending is not None:
            broken.append(i)
            lengths, finish = [len(a), len(b)], [fa, fb]
            detail.append({"row": i, "ending": ending, "lengths": lengths, "finish": finish})
        elif a == b:
            identical.append(i)
        else:
            diverging.append((i, first_difference(a, b)))
    tops = score([prompts[i] + tier_rows[i][0][:d] for i, d in diverging]) if diverging else []
    for (i, d), top in zip(diverging, tops, strict=True):
        ids = [t for t, _ in top]
        mine, other = tier_rows[i][0][d], ample_rows[i][0][d]
        if mine not in ids[:5] or other not in ids[:5]:
            broken.append(i)
            detail.append(
                {
                    "row": i,
                    "position": d,
                    "tokens": [mine, other],
                    "ranks": [ids.index(t) if t in ids else None for t in (mine, other)],
                    "lengths": [len(tier_rows[i][0]), len(ample_rows[i][0])],
                    "top": [[t, round(lp, 4)] for t, lp in top],
                }
            )
    detail.sort(key=lambda x: x["row"])
    return {
        "identical_rows": len(identical),
        "close_rows": len(tier_rows) - len(identical) - len(broken),
        "broken_rows": len(broken),
        "broken": sorted(broken)[:50],
        "broken_detail": detail[:20],
        "divergence_positions": sorted(d for _, d in diverging)[:50],
    }


def compare_debug(tier, ample) -> dict:
    """(token ids, per-token logprobs, finish reason) rows, each side's own top-5 at the
    divergence; ignore_eos, so every row ends by length."""
    identical = sum(a[0] == b[0] and a[2] == b[2] for a, b in zip(tier, ample, strict=True))
    broken = [
        i
        for i, (a, b) in enumerate(zip(tier, ample, strict=True))
        if not close_under_top5(
            a[0],
            b[0],
            top5_from_logprobs(a[1]),
            top5_from_logprobs(b[1]),
            a_finish=a[2],
            b_finish=b[2],
        )
    ]
    return {
        "identical_rows": identical,
        "close_rows": len(tier) - identical - len(broken),
        "broken_rows": len(broken),
        "broken": broken[:50],
    }


def run(model, prompts, params, after=None, swap_every: int = 0, record: bool = False, **kw):
    """Generate on a fresh engine, then free it; after(llm, rows) runs on it first.
    record: the fourth value returned is the engine's launched steps (StepRecorder), their
    request ids renamed probe<i> for prompt i.
    swap_every > 0: the engine is driven step by step and, every swap_every steps, its
    pool re-created at the same size (reconfigure), which preempts, so swaps (the
    tier's policy permitting), every running request; metrics then count the requests
    preempted at least once ("requests_preempted") and the reconfigures."""
    import torch

    from batchgen import LLM

    with threads_for(kw["device"]):
        llm = LLM(model=model, **kw)
        recorder = StepRecorder(llm.engine) if record else None
        t0 = time.perf_counter()
        if swap_every:
            outs, forced = _generate_swapping(llm.engine, prompts, params, swap_every)
        else:
            outs, forced = llm.generate(prompts, params, use_tqdm=False), {}
        wall = time.perf_counter() - t0
        metrics = llm.engine.metrics() | forced
        page_size = llm.engine.config.page_size
        metrics["host_prefix_hit_tokens"] = metrics.get("host_prefix_hit_pages", 0) * page_size
        if llm.engine.executor.size > 1 and llm.engine.tier is not None:
            # each worker rank's own copies (rank 0's are the metrics above)
            metrics["worker_tiers"] = llm.engine.tier_worker_metrics()
        rows = (
            [(list(c.token_ids), c.logprobs, c.finish_reason) for c in (o.outputs[0] for o in outs)]
            if not swap_every
            else outs
        )
        extra = after(llm, rows) if after is not None else None
        if recorder is not None:
            extra = [[(_probe_id(r), s, n) for r, s, n in step] for step in recorder.steps]
        if llm.engine.tier is not None:
            llm.engine.tier.copies.close()
        llm.engine.shutdown()
        del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, metrics, wall, extra


def _probe_id(request_id: str) -> str:
    """probe<i> for generate()'s request id <call>-<i> (and for probe<i> itself)."""
    return request_id if request_id.startswith("probe") else f"probe{request_id.split('-')[-1]}"


def replay(model, prompts, params, steps, **kw) -> tuple[list[list[int]], float]:
    """The recorded tier run's steps computed again by an engine with the ample pool and
    no tier (schedule_replay.py): (each prompt's tokens, wall seconds)."""
    import torch

    from batchgen import LLM

    kw = dict(kw, host_kv_size_gib=0, enable_prefix_caching=False, pipeline_decode=False)
    with threads_for(kw["device"]):
        llm = LLM(model=model, **kw)
        eng = llm.engine
        scheduler = ReplayScheduler.install(eng, steps)
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            eng.add_request(f"probe{i}", prompt, replay_params(params))
        while not scheduler.done:
            eng.step()
        wall = time.perf_counter() - t0
        rows = [list(scheduler.by_id[f"probe{i}"].output_token_ids) for i in range(len(prompts))]
        eng.shutdown()
        del llm, eng, scheduler
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, wall


def reconfiguring(eng, prompts, params, every: int, tag: str) -> tuple[list, int]:
    """The prompts (params: one for all, or one each) run to the end on `eng`, every
    `every`-th step reconfiguring the pool while requests run (each preempted and
    resumed); (the requests in prompt order, the reconfigures made)."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, each)):
        eng.add_request(f"{tag}{i}", prompt, p)
    done, steps, reconfigures = {}, 0, 0
    while eng.has_unfinished:
        done.update((r.request_id, r) for r in eng.step())
        steps += 1
        if steps % every == 0 and eng.scheduler.running:
            eng.reconfigure(eng.pool.num_pages)
            reconfigures += 1
    done.update((r.request_id, r) for r in eng.step())  # what a last drain finished
    return [done[f"{tag}{i}"] for i in range(len(prompts))], reconfigures


def _generate_swapping(eng, prompts, params, every: int) -> tuple[list, dict]:
    """run()'s swap_every: (rows of token ids, no logprobs, finish reason; the counts it
    adds)."""
    reqs, reconfigures = reconfiguring(eng, prompts, params, every, "probe")
    rows = [(list(r.output_token_ids), None, r.finish_reason) for r in reqs]
    spared = [len(r.output_token_ids) for r in reqs if not r.num_preemptions]
    counts = {
        "reconfigures": reconfigures,
        "requests_preempted": len(reqs) - len(spared),
        # a request that ends before a reconfigure finds it running is never preempted
        "longest_output_never_preempted": max(spared, default=0),
    }
    return rows, counts


SCORED = 10  # tokens scored at a divergence: the rule reads five, a broken row shows ten


def top_scorer(llm):
    """score(prompts): the SCORED most likely next tokens after each prompt as (token id,
    logprob) pairs, best first (one greedy token, logprobs=SCORED), on an idle engine."""
    from batchgen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=SCORED, ignore_eos=True)

    def score(prompts):
        outs = llm.generate(prompts, params, use_tqdm=False)
        steps = [o.outputs[0].logprobs[0] for o in outs]
        return [
            sorted(((t, lp.logprob) for t, lp in s.items()), key=lambda x: -x[1]) for s in steps
        ]

    return score


def resolve_model(args) -> tuple[str | None, dict, int]:
    """(LLM's model argument, engine keywords it needs, largest prompt token id)."""
    if args.model in MODELS:
        config, path = dummy_model(args)
        return str(path), {"load_format": "dummy"}, min(10000, config["vocab_size"] - 1)
    if args.model == "default":
        return None, {}, 10000  # SmolLM2's vocabulary has 49,152 tokens
    from batchgen.models.loader import ModelSource

    vocab = ModelSource.resolve(args.model).load_config().vocab_size
    return args.model, {}, min(10000, vocab - 1)


def make_prompts(n: int, length: int, max_token: int) -> list[list[int]]:
    rng = random.Random(0)
    jitter = min(50, length // 4)
    return [
        [rng.randint(0, max_token) for _ in range(max(1, length + rng.randint(-jitter, jitter)))]
        for _ in range(n)
    ]


def main(argv=None) -> int:
    from batchgen import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="512 (--small: 16)")
    ap.add_argument("--prompt-len", type=int, default=None, help="1000 (--small: 48)")
    ap.add_argument("--output-len", type=int, default=None, help="128 (--small: 16)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="tier run's device KV pool")
    ap.add_argument("--kv-pages", type=int, default=40, help="--small: tier run's pool pages")
    ap.add_argument("--host-gib", type=float, default=None, help="32 (--small: 0.002)")
    ap.add_argument(
        "--tp", type=int, default=1, help="tensor_parallel_size of both runs (see above)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--tier-policy", default=engine_default("tier_policy"), choices=("auto", "always")
    )
    ap.add_argument(
        "--decode-append",
        default=engine_default("decode_append"),
        choices=("off", "batched", "layer"),
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--debug", action="store_true", help="the batchgen_debug probe (see above)")
    mode.add_argument(
        "--readback", action="store_true", help="default mode, batchgen_debug on the tier run"
    )
    ap.add_argument(
        "--swap-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="default modes: every STEPS steps of the tier run, reconfigure() re-creates "
        "its pool at the same size, preempting every running request (see above)",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="default mode: + an ample run at half --max-num-seqs, judged the same way",
    )
    ap.add_argument(
        "--replay",
        action="store_true",
        help="default modes: + the tier run's steps replayed with the ample pool (same rows, "
        "same shapes; only where KV lived differs), judged the same way; decides the exit",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help="GPU runs' dtype (default: bfloat16 for the random-weight models, else the "
        "checkpoint's); float32 makes batching's rounding differences, and a random MoE's "
        "routing flips, about 65,000 times rarer (but MoE decode then runs eagerly)",
    )
    ap.add_argument("--model", default="qwen3-0.6b", help="a name, 'default' or a path")
    ap.add_argument("--small", action="store_true", help="CPU-sized smoke run")
    ap.add_argument("--ckpt", type=Path, default=None, help="directory for --model's config")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    small = dict(requests=16, prompt_len=48, output_len=16)
    full = dict(requests=512, prompt_len=1000, output_len=128)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    model, model_kw, max_token = resolve_model(args)
    prompts = make_prompts(args.requests, args.prompt_len, max_token)
    common = dict(model_kw, max_num_seqs=args.max_num_seqs)
    if args.small:
        longest = args.prompt_len + min(50, args.prompt_len // 4) + args.output_len
        common.update(dtype="float32", device="cpu", max_model_len=max(96, longest), page_size=4)
        host_gib = 0.002 if args.host_gib is None else args.host_gib
        tight = dict(num_kv_pages=args.kv_pages, host_kv_size_gib=host_gib)
    else:
        dtype = args.dtype or ("bfloat16" if model_kw else "auto")
        common.update(dtype=dtype, device="cuda", max_model_len=2048)
        host_gib = 32.0 if args.host_gib is None else args.host_gib
        tight = dict(kv_cache_size_gib=args.kv_gib, host_kv_size_gib=host_gib)
    tight.update(tier_policy=args.tier_policy, decode_append=args.decode_append)
    if args.tp > 1:  # both runs, the same draw of dummy weights
        common.update(tensor_parallel_size=args.tp)
    if args.readback:
        tight["batchgen_debug"] = True

    if args.debug and args.swap_every:
        ap.error("--swap-every drives the default modes' tier run, not --debug's")
    if args.replay and (args.debug or args.tp > 1):
        ap.error("--replay replays a default mode's tier run on one rank")
    if args.debug:
        params = SamplingParams(
            temperature=0, max_tokens=args.output_len, ignore_eos=True, logprobs=5
        )
        tier_rows, m_tier, wall_tier, _ = run(
            model, prompts, params, batchgen_debug=True, **tight, **common
        )
        ample_rows, m_ample, wall_ample, _ = run(model, prompts, params, **common)
        verdict = compare_debug(tier_rows, ample_rows)
        verdict["readback_mismatches"] = 0  # a mismatch raises KVReadbackError
    else:
        params = SamplingParams(temperature=0, max_tokens=args.output_len)
        tier_rows, m_tier, wall_tier, steps = run(
            model,
            prompts,
            params,
            swap_every=args.swap_every,
            record=args.replay,
            **tight,
            **common,
        )
        tier_ends = [(r[0], r[2]) for r in tier_rows]
        replay_ends = wall_replay = None
        if args.replay:
            # a replayed request ignores stops and ends where the recording's rows do (plus
            # the extra token a pipelined step computed after an EOS, cut here): its tokens
            # are judged over the tier run's output, with the tier run's ending and no EOS
            # ids, so a replay row shorter than the tier run's still reads as cut short
            replayed, wall_replay = replay(model, prompts, params, steps, **common)
            replay_ends = [(r[: len(t)], f) for r, (t, f) in zip(replayed, tier_ends, strict=True)]
        control_ends = None
        if args.control:  # no tier, other batches: what batching alone changes
            half = dict(common, max_num_seqs=max(1, args.max_num_seqs // 2))
            control_ends = [(r[0], r[2]) for r in run(model, prompts, params, **half)[0]]

        def judge(llm, rows):
            ample_ends, score = [(r[0], r[2]) for r in rows], top_scorer(llm)
            eos = llm.engine.eos_token_ids
            verdict = compare(prompts, tier_ends, ample_ends, score, eos)
            if control_ends is not None:
                verdict["control"] = compare(prompts, control_ends, ample_ends, score, eos)
            if replay_ends is not None:  # the tier run against its own batching
                verdict["replay"] = compare(prompts, tier_ends, replay_ends, score)
            return verdict

        ample_rows, m_ample, wall_ample, verdict = run(
            model, prompts, params, after=judge, **common
        )
        if args.readback:
            verdict["readback_mismatches"] = 0  # a mismatch raises KVReadbackError
    lost = sum(not r[0] for r in tier_rows) + sum(not r[0] for r in ample_rows)
    result = {
        "mode": "debug" if args.debug else "default + readback" if args.readback else "default",
        "model": model or "batchgen default model",
        "requests": args.requests,
        "tier_run": dict(tight, **common),
        **verdict,
        **(
            {"control_max_num_seqs": max(1, args.max_num_seqs // 2)} if "control" in verdict else {}
        ),
        "rows_without_output": lost,
        "eos_endings": {
            "tier": sum(r[2] == "stop" for r in tier_rows),
            "ample": sum(r[2] == "stop" for r in ample_rows),
        },
        "copies": copy_rates(m_tier),
        "offload_run": m_tier,
        "offload_wall_s": wall_tier,
        "ample_run": m_ample,
        "ample_wall_s": wall_ample,
    }
    if args.replay:
        result["replay_steps"] = len(steps)
        result["replay_wall_s"] = wall_replay
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_offload.json").write_text(json.dumps(result, indent=2))
    shown = {k: v for k, v in result.items() if k not in ("offload_run", "ample_run")}
    sys.stdout.write(json.dumps(shown, indent=1) + "\n")
    tier_line = {k: m_tier.get(k) for k in (*TIER_KEYS, "host_prefix_hit_tokens")}
    sys.stdout.write("tier run: " + json.dumps(tier_line) + "\n")
    for rank, worker in enumerate(m_tier.get("worker_tiers") or [], 1):
        sys.stdout.write(f"tier run, rank {rank}: " + json.dumps(worker) + "\n")
    if not m_tier.get("swaps_out"):
        sys.stdout.write("note: the tier run swapped nothing (see tier_policy, --kv-gib)\n")
    judged = verdict["replay"] if args.replay else verdict
    return 0 if judged["broken_rows"] == 0 and lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
