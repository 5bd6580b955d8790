"""The engine's host time: what a step costs the CPU besides the model's forward.

    PYTHONPATH=src python3 -m benchmarks.host_overhead --requests 8000     # many prompts
    PYTHONPATH=src python3 -m benchmarks.host_overhead --w6-steps 4        # W6's step shape
    PYTHONPATH=src python3 -m benchmarks.host_overhead --device cuda ...   # the GPU's host
    PYTHONPATH=src python3 -m benchmarks.host_overhead --chat 2048         # W7, ~900 rows

Two measurements, each on a model small enough that the forward is not the point:
- `--requests N`: N prompts of 20-60 random tokens, sharing nothing, through
  `LLM.generate` (8 output tokens each, greedy, ignore_eos) on a 2-layer Qwen3-shaped
  model (workloads.SMALL_MODEL). The wall time less the time inside the runner's
  forward is the host's: adding, scheduling, preparing, sampling, updating. Per request
  it should not grow with N (a batch file holds thousands).
- `--w6-steps K`: W6's scheduling shape (512 prompts of 1024 tokens, 32,768 tokens a
  step, max_num_seqs 512; its CPU-sized model, workloads.SMALL_KIMI) for K steps: the
  host milliseconds of each step in schedule, prepare, update and the rest, and the
  seconds it took to add the 512 requests. On the GPU these are the edges of a prefill
  step, where the GPU waits for the host.
- `--chat N`: W7's batch job (`batchgen run`'s path, sampled, seeded, EOS endings) over
  N requests at --rows running rows, host ms a step by phase (chat_host.py).

Prints a JSON summary and writes host_overhead.json into --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.engine_runs import built_engine, timed_into
from benchmarks.workloads import SMALL_KIMI, SMALL_MODEL, config_dir, w4_requests

# calls timed in --w6-steps: (name, object path from the engine, method); "forward" is
# the model's (on the CPU it computes; on a GPU it queues the kernels), the rest is host
STEP_CALLS = (
    ("schedule", "scheduler", "schedule"),
    ("update", "scheduler", "update"),
    ("prepare", "runner", "prepare"),
    ("forward", "runner.model", "forward"),
)


def wrap_calls(eng, spent: dict[str, float]) -> None:
    """Time STEP_CALLS on this engine's objects (instance attributes: the engine is
    freed after the run)."""
    for name, path, method in STEP_CALLS:
        owner = eng
        for part in path.split("."):
            owner = getattr(owner, part)
        setattr(owner, method, timed_into(spent, name, getattr(owner, method)))


def many_requests(args, work: Path) -> dict:
    from batchgen import SamplingParams

    ckpt = config_dir(work / "small_qwen3", SMALL_MODEL, "float32")
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randint(3, 500) for _ in range(rng.randint(20, 60))]}
        for _ in range(args.requests)
    ]
    kw = dict(dtype="float32", device=args.device, load_format="dummy", max_model_len=256)
    with built_engine(ckpt, **kw) as llm:
        spent: dict[str, float] = {}
        model = llm.engine.runner.model
        model.forward = timed_into(spent, "forward", model.forward)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = llm.engine.stats.steps
    assert len(outs) == args.requests and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    host = wall - spent["forward"]
    return {
        "requests": args.requests,
        "steps": steps,
        "wall_s": round(wall, 3),
        "forward_s": round(spent["forward"], 3),
        "host_s": round(host, 3),
        "host_us_per_request": round(host / args.requests * 1e6, 1),
    }


def w6_steps(args, work: Path) -> dict:
    from batchgen import SamplingParams

    ckpt = config_dir(work / "small_kimi", SMALL_KIMI, "float32")
    prompts, _ = w4_requests()
    vocab = SMALL_KIMI["vocab_size"]
    prompts = [[3 + t % (vocab - 3) for t in p] for p in prompts]  # into the small vocabulary
    kw = dict(
        dtype="float32",
        device=args.device,
        load_format="dummy",
        max_model_len=1200,
        max_num_batched_tokens=32768,
        max_num_seqs=512,
        host_kv_size_gib=1,
    )
    with built_engine(ckpt, **kw) as llm:
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(f"w6-{i}", p, params)
        added = time.perf_counter() - start
        spent: dict[str, float] = {}
        wrap_calls(eng, spent)
        rows = []
        for _ in range(args.w6_steps):
            spent.clear()
            start = time.perf_counter()
            eng.step()
            wall = time.perf_counter() - start
            row = {name: round(spent.get(name, 0.0) * 1e3, 2) for name, _, _ in STEP_CALLS}
            row["host"] = round((wall - spent.get("forward", 0.0)) * 1e3, 2)
            rows.append(row)
    later = rows[1:] or rows  # the first step also pays first-call costs
    median = {k: sorted(r[k] for r in later)[len(later) // 2] for k in rows[0]}
    return {"add_512_s": round(added, 4), "steps_ms": rows, "median_after_first_ms": median}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=0, help="N prompts through generate()")
    ap.add_argument("--w6-steps", type=int, default=0, help="K steps of W6's shape")
    ap.add_argument("--chat", type=int, default=0, help="N W7 requests through the job")
    ap.add_argument("--rows", type=int, default=900, help="--chat: max_num_seqs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchgen-host-overhead"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.requests or args.w6_steps or args.chat):
        ap.error("give --requests N, --w6-steps K, --chat N or several")
    import torch

    result = {"device": args.device, "torch_threads": torch.get_num_threads()}
    if args.requests:
        result["many_requests"] = many_requests(args, args.work)
    if args.w6_steps:
        result["w6_steps"] = w6_steps(args, args.work)
    if args.chat:
        from benchmarks import chat_host

        chat = argparse.Namespace(
            requests=args.chat,
            rows=args.rows,
            work=args.work,
            eos_every=160,
            profile=None,
            clock="wall",
        )
        result["chat"] = chat_host.run(chat)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_overhead.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
