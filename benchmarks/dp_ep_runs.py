"""W8's runs (dp_ep.py), one a process: an engine of several ranks timed in this process
(dp-ep, tp), Ray data parallel's independent engines over a batch file (engines), and
the probe that builds one of those engines alone to count its KV pages."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from benchmarks.card import sync
from benchmarks.engine_runs import RATES, STATIC


def timed_engine(ckpt: Path, prompts, out_lens, kw: dict, sample_every: int) -> dict:
    """Every prompt greedily to its output length (ignore_eos) on an LLM built with kw
    (attention DP + EP or tensor parallel), after a warm-up shaped like the workload; the
    step messages' bytes of each step, and each rank's pages held every sample_every
    steps."""
    from batchgen import LLM, SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    built = time.perf_counter()
    llm = LLM(model=str(ckpt), **kw)
    eng = llm.engine
    try:
        warming = time.perf_counter()
        warm = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate(warm_up(eng, prompts), warm, use_tqdm=False)
        startup = {"build_s": warming - built, "warmup_s": time.perf_counter() - warming}
        sent = step_bytes(eng)
        before = eng.metrics()
        sync(kw["device"])
        lengths: dict[str, int] = {}
        per_step: list[int] = []
        peak = held_pages(eng)
        with fewer_full_collections():  # as LLM.generate runs
            start = time.perf_counter()
            for i, (p, n) in enumerate(zip(prompts, out_lens)):
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                eng.add_request(f"r{i}", p, params)
            last = sent()
            while eng.has_unfinished:
                for req in eng.step():
                    lengths[req.request_id] = len(req.output_token_ids)
                now = sent()
                per_step.append(now - last)
                last = now
                if len(per_step) % sample_every == 0:
                    peak = [max(a, b) for a, b in zip(peak, held_pages(eng))]
            sync(kw["device"])
            wall = time.perf_counter() - start
        after = eng.metrics()
        pools = rank_pools(eng)
    finally:
        shut_down(eng)
    size = len(pools)
    out = sum(lengths.values())
    distinct = sum(pools) if kw.get("data_parallel_size", 1) > 1 else pools[0]
    return {
        "gpus": size,
        "wall_s": wall,
        "output_tokens": out,
        "tok_s": out / wall,
        "tok_s_per_gpu": out / wall / size,
        "requests_answered": len(lengths),
        "all_outputs": all(lengths.get(f"r{i}") == n for i, n in enumerate(out_lens)),
        "kv_pages_per_gpu": pools,
        "kv_capacity_pages": distinct,
        "kv_pages_held_peak": peak,
        "bytes_per_step_mean": sum(per_step) / len(per_step) if per_step else 0.0,
        "bytes_per_step_max": max(per_step, default=0),
        "steps": len(per_step),
        "step_bytes": per_step,  # each engine step's messages, in bytes
        "counters": counted(before, after),
        "startup": startup,
    }


def warm_up(eng, prompts) -> list[list[int]]:
    """The first prompts reversed (no page of them is a workload prefix): on each rank a
    full prefill step, a step that cuts a prompt at the token budget, and its rest."""
    ranks = getattr(eng, "size", 1)
    per_step = max(1, eng.config.max_num_batched_tokens // len(prompts[0]))
    return [p[::-1] for p in prompts[: ranks * (2 * per_step + 1)]]


def step_bytes(eng):
    """A function giving the step messages' bytes rank 0 has sent so far."""
    from batchgen.distributed.messages import DPStep
    from batchgen.engine.dp_attention import DPEngine

    if isinstance(eng, DPEngine):
        return lambda: eng.workers.message_metrics(DPStep)["step_message_bytes_total"]
    return lambda: eng.executor.step_metrics().get("step_message_bytes_total", 0)


def held_pages(eng) -> list[int]:
    """The device pages each rank's requests hold now (tensor parallel: every rank holds
    rank 0's)."""
    if hasattr(eng, "rank_pages"):
        return [sum(pages.values()) for pages in eng.rank_pages()]
    return [sum(map(len, eng.kv.pages.values()))] * eng.executor.size


def rank_pools(eng) -> list[int]:
    """Each rank's device pool, in pages (tensor parallel: rank 0's, planned as the
    fewest any rank's GPU has room for)."""
    if hasattr(eng, "rank_metrics"):
        return [m["kv_pages"] for m in eng.rank_metrics()]
    return [eng.metrics()["kv_pages"]] * eng.executor.size


def counted(before: dict, after: dict) -> dict:
    """The timed part's counters (preemptions, swaps, tier traffic, step messages); what
    describes the engine (its pool, weights, the tier's cost rule) and rates are left out."""
    return {
        k: v - before.get(k, 0)
        for k, v in after.items()
        if isinstance(v, (int, float))
        and not isinstance(v, bool)
        and not k.startswith(STATIC)
        and k not in (*RATES, "step_message_bytes")
    }


def shut_down(eng) -> None:
    """Stop the other ranks and rank 0's copy worker."""
    local = getattr(eng, "local", eng)
    if local.tier is not None:
        local.tier.copies.close()
    eng.shutdown()


def probe(ckpt: Path, kw: dict) -> dict:
    """One engine built as each of the `engines` layout's is: its pool and weights."""
    from batchgen import LLM

    built = time.perf_counter()
    llm = LLM(model=str(ckpt), **kw)
    try:
        metrics = llm.engine.metrics()
    finally:
        shut_down(llm.engine)
    return {
        "kv_pages": metrics["kv_pages"],
        "weight_bytes": metrics["weight_bytes"],
        "build_s": time.perf_counter() - built,
    }


def run_engines(ckpt: Path, prompts, out_lens, kw: dict, gpus: int, shard_size: int) -> dict:
    """The requests as a batch file through Ray data parallel (`batchgen run
    --data-parallel N`'s run_data_parallel): N one-GPU engines (on the CPU, one core
    each) on a local Ray cluster this process starts."""
    import ray

    from batchgen.api.batch_job import JobOptions
    from batchgen.api.data_parallel import DataParallelOptions, run_data_parallel
    from batchgen.config import LARGE_GPU_LIMITS

    cpu = kw["device"] == "cpu"
    if cpu:
        os.environ["OMP_NUM_THREADS"] = "1"  # the raylet's, which its workers inherit
    ray.init(
        address="local",
        num_cpus=gpus if cpu else None,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "w8.jsonl", Path(tmp) / "w8.out.jsonl"
            inp.write_text(
                "".join(
                    batch_line(i, p, n) + "\n" for i, (p, n) in enumerate(zip(prompts, out_lens))
                )
            )
            seqs = kw.get("max_num_seqs") or LARGE_GPU_LIMITS[0]
            opts = JobOptions(inp, out, "w8", max_in_flight=4 * seqs, progress=False)
            dp = DataParallelOptions(gpus, str(ckpt), kw, shard_size=shard_size)
            summary = run_data_parallel(opts, dp)
            answered = {}
            for line in out.read_text().splitlines():
                row = json.loads(line)
                answered[row["custom_id"]] = row["response"]["body"]["usage"]["completion_tokens"]
    finally:
        ray.shutdown()
    tok_s = summary.completion_tokens / summary.wall_s
    return {
        "gpus": gpus,
        "wall_s": summary.wall_s,
        "output_tokens": summary.completion_tokens,
        "tok_s": tok_s,
        "tok_s_per_gpu": tok_s / gpus,
        "requests_answered": len(answered),
        "all_outputs": all(answered.get(f"r{i}") == n for i, n in enumerate(out_lens)),
        "failed": summary.failed,
        "kv_pages_held_peak": None,  # inside the actors: not seen
        "bytes_per_step_mean": None,  # independent engines send no step messages
        "bytes_per_step_max": None,
        "steps": None,
    }


def batch_line(i: int, prompt: list[int], max_tokens: int) -> str:
    """Request i as a batch file line: the prompt's token ids, greedy, ignore_eos."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return json.dumps(
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
    )
