"""Replay a workload's schedule and KV traffic on the CPU, without a model.

    python3 -m benchmarks.tier_replay --workload w2                # W2, ~10 s
    python3 -m benchmarks.tier_replay --workload w3 --admission arrival
    python3 -m benchmarks.tier_replay --workload w3 --model llama-3.1-8b
    python3 -m benchmarks.tier_replay --workload w4 --model moonlight-w4 --kv-gib 94 --host-gib 32
    python3 -m benchmarks.tier_replay --small                      # seconds, for CI

The real Scheduler, KVCacheManager, PageAllocator and TieredKVManager run the workload
step by step with page pools sized as the GPU runs size them (--kv-gib and --host-gib
over the model's KV bytes per page), but with tiny pages (one layer, one head of 4
floats) and a stand-in for the forward: every scheduled token counts as computed and
every sampled token is drawn at random (ignore_eos, so each request runs to its length).
Copies run on the CPU CopyEngine and finish at once, so a store is on host by the next
step (on the GPU a store may still be in flight); otherwise the decisions are the
engine's: admission order, preemption, swaps, evictions, write-backs and loads, and, as
in the engine's default pipelined decode, a decode step followed by the next one built
blind (`pipeline.next_decode`) whenever the engine would (--no-pipeline: every step from
`Scheduler.schedule`). Requests are added as `EngineCore.add_request` adds them (`want`,
then `Scheduler.add`).

What it is for: the tier's traffic and the scheduler's work at full workload size, in
seconds and with no GPU: steps, tokens computed, preemptions, swaps, recomputes, the host
seconds of adding the requests (`add_seconds`) and of the steps (`step_seconds`: the
scheduler, KV manager and tier bookkeeping, waits for the CPU copies included;
`step_cpu_seconds`: the replaying thread's CPU time alone, the copy threads' left out;
`host_ms_per_step` of decode steps and of the others, with prefill: what the host spends
outside the runner between two steps' forwards),
the steps whose forward waits on a copy (`steps_waiting_on_copies`, decode steps and
others: on a GPU each such step waits for a write-back's read or a load, the gap
between streams included), tokens per step, bytes
by reason (scaled to the model's KV bytes per token, from its workloads.MODELS config:
qwen3-0.6b 112 KiB, llama-3.1-8b 128 KiB, moonlight-w4 30 KiB) and the host blocks the page copies move (pages per block: how well host pages
run together). It says nothing about GPU time. Runs the host tier on and off, one after
the other (--off-first: off, then on), and prints both, on first; --out writes
tier_replay.json. The first run in the process pays for memory the second reuses: its
add_seconds (and, less, its step seconds) come out higher whichever tier it is, so
compare a tier's two orders, not the two runs of one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from batchgen.engine.pipeline import next_decode
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.kv import page_copies
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.tiered import TieredKVManager
from batchgen.runner.batch import ModelRunnerOutput
from batchgen.sampling_params import SamplingParams
from benchmarks.workloads import MODELS, w2_requests, w3_requests, w4_requests

PAGE_SIZE = 16


def bytes_per_token(model: str) -> int:
    """KV bytes of one token of the workloads.MODELS model in bf16, every layer: K and V
    (MHA/GQA), or the latent state (MLA: kv_lora_rank + qk_rope_head_dim)."""
    cfg = MODELS[model][0]
    if "kv_lora_rank" in cfg:
        per_layer = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    return cfg["num_hidden_layers"] * per_layer * 2


def workload(name: str, small: bool) -> tuple[list[list[int]], list[int]]:
    if name == "w2":
        if small:
            return w2_requests(n=24, prompt_lens=(32, 96), out_lens=(16, 48), max_token=500)
        return w2_requests()
    if name == "w4":
        return w4_requests(n=16, prompt_len=96, out_len=8) if small else w4_requests()
    if small:
        return w3_requests(8, 4, prefix_len=96, question_len=8, out_len=4, max_token=500)
    return w3_requests()


class BlockCounter:
    """Counts the host blocks page_copies moves (one per run of consecutive host pages
    and layer) while installed."""

    def __init__(self) -> None:
        self.copies = self.blocks = self.pages = 0
        self._runs = page_copies._runs

    def __enter__(self) -> BlockCounter:
        def runs(pages):
            out = self._runs(pages)
            self.copies += 1
            self.blocks += len(out)
            self.pages += len(pages)
            return out

        page_copies._runs = runs
        return self

    def __exit__(self, *exc) -> None:
        page_copies._runs = self._runs


def replay(prompts, out_lens, args, tier_on: bool) -> dict:
    page_bytes = bytes_per_token(args.model) * PAGE_SIZE
    dev_pages = args.num_pages or int(args.kv_gib * 2**30 // page_bytes)
    layout = KVLayout(1, 1, 4, PAGE_SIZE, torch.float32)
    allocator = PageAllocator(dev_pages, True)
    tier = None
    if tier_on:
        host_pages = int(args.host_gib * 2**30 // page_bytes)
        tier = TieredKVManager(
            PagePool(layout, dev_pages, torch.device("cpu")),
            HostPool(layout, host_pages, False),
            allocator,
            CopyEngine(torch.device("cpu"), background=True),
            debug=False,
            loads_pay=True,
        )
    kv = KVCacheManager(allocator, PAGE_SIZE, tier, "off")
    sched = Scheduler(kv, args.max_num_seqs, args.max_batched_tokens, 4096, [-1], args.admission)
    requests = {}
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, out_lens)):
        req = Request(str(i), list(prompt), SamplingParams(max_tokens=n, ignore_eos=True), n, i)
        requests[req.request_id] = req
        kv.want(req.request_id, req.token_ids)
        sched.add(req)
    add_seconds = time.perf_counter() - start
    rng = random.Random(1)
    computed = steps = 0
    waiting_steps = {"decode": 0, "other": 0}  # steps whose forward waits on a copy
    queued = None  # a decode step built blind, as the engine's pipeline queues it
    seconds = {"decode": 0.0, "other": 0.0}  # host seconds of each kind of step
    counts = {"decode": 0, "other": 0}

    def run_step(out, copies) -> None:
        nonlocal computed, steps
        kind = "decode" if _decode_only(out) else "other"
        counts[kind] += 1
        for handle in copies.wait_for:
            handle.synchronize()
        if copies.wait_for:
            waiting_steps[kind] += 1
        ids = [s.request_id for s in out.requests if s.sample]
        tokens = [rng.randint(0, 10_000) for _ in ids]
        sched.update(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)), requests)
        computed += out.num_tokens
        steps += 1

    def engine_step() -> None:
        """One EngineCore._step: poll, schedule (or the queued decode), run."""
        nonlocal queued
        if kv.tier is not None:
            kv.tier.poll()
        if queued is None:
            out = sched.schedule()
            copies = sched.take_copies()
            if out.is_empty:
                sched.unsend(out)  # as in the engine: only copies in flight may hold it up
                if kv.tier is None or not kv.tier.num_in_flight:
                    raise RuntimeError("no request could be scheduled")
                kv.tier.drain()
                return
            if not (args.pipeline and _decode_only(out)):
                run_step(out, copies)
                return
            queued = (out, copies)
        current = queued
        queued = next_decode(current[0], sched, kv, requests)
        run_step(*current)

    start, cpu_start = time.perf_counter(), time.thread_time()
    with BlockCounter() as blocks:
        while sched.has_unfinished or queued is not None:
            t0, before = time.perf_counter(), dict(counts)
            engine_step()
            for kind in counts:
                if counts[kind] > before[kind]:
                    seconds[kind] += time.perf_counter() - t0
        if kv.tier is not None:
            kv.tier.drain()
    result = {
        "host_tier": tier_on,
        "steps": steps,
        "computed_tokens": computed,
        "preemptions": sched.num_preemptions,
        "recomputes": sched.num_recomputes,
        "device_pages": dev_pages,
        "add_seconds": add_seconds,
        "step_seconds": time.perf_counter() - start,
        "step_cpu_seconds": time.thread_time() - cpu_start,
        "tokens_per_step": computed / max(steps, 1),
        "steps_waiting_on_copies": waiting_steps,
        "steps_by_kind": counts,
        "host_ms_per_step": {k: 1000 * seconds[k] / max(counts[k], 1) for k in counts},
    }
    if kv.tier is not None:
        scale = page_bytes / layout.bytes_per_page
        m = kv.tier.metrics
        result["swaps_out"], result["swaps_in"] = m.swaps_out, m.swaps_in
        result["gib_by_reason"] = {
            reason: n * scale / 2**30 for reason, n in m.bytes_by_reason.items() if n
        }
        result["copies"] = blocks.copies
        result["pages_per_block"] = blocks.pages / max(blocks.blocks, 1)
    return result


def _decode_only(out) -> bool:
    """A step the engine's pipeline queues: every request computes one token and samples
    (the replay's requests have no penalties or logprobs, which would stop it)."""
    return all(len(s.new_token_ids) == 1 and s.sample for s in out.requests)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("w2", "w3", "w4"), default="w2")
    # models with linear-attention layers carry state slots the replay does not model
    paged = sorted(name for name, (cfg, _) in MODELS.items() if "layer_types" not in cfg)
    ap.add_argument("--model", choices=paged, default="qwen3-0.6b")
    ap.add_argument("--admission", choices=("prefix", "arrival"), default="prefix")
    ap.add_argument("--kv-gib", type=float, default=None, help="device pool (W2 8, W3 4)")
    ap.add_argument("--host-gib", type=float, default=64.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--small", action="store_true", help="the CPU-sized workload")
    ap.add_argument("--off-first", action="store_true", help="replay tier off, then on")
    ap.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        help="every step from Scheduler.schedule (the engine's pipeline_decode=False)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.kv_gib is None:
        args.kv_gib = 8.0 if args.workload == "w2" else 4.0
    args.num_pages = 20 if args.small else None
    if args.small:
        args.host_gib = 0.01
    prompts, out_lens = workload(args.workload, args.small)
    order = (False, True) if args.off_first else (True, False)
    runs = sorted(
        (replay(prompts, out_lens, args, tier) for tier in order),
        key=lambda run: not run["host_tier"],
    )
    for run in runs:
        sys.stdout.write(json.dumps(run) + "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = dict(vars(args), out=str(args.out), runs=runs)
        (args.out / "tier_replay.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
