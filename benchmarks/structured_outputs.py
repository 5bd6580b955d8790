"""Structured outputs: the throughput cost of JSON-schema constraints on the GPU.

    PYTHONPATH=src python3 -m benchmarks.structured_outputs --out $OUT            # GPU, ~1 min
    PYTHONPATH=src python3 -m benchmarks.structured_outputs --small --out /tmp/so  # CPU, 4 requests

The embedded default model (SmolLM2-135M-Instruct, its own tokenizer; --model for another)
in the default configuration (bf16 on a GPU, CUDA graphs, pipelined decode). --n chat
requests (256) each ask to extract a person record from a generated sentence into JSON
under SCHEMA (strings bounded by maxLength), greedy, max_tokens 256.

1. constrained: every request with `structured_outputs=json SCHEMA`, timed. Every answer
   that ends by EOS must parse and validate against SCHEMA, and at least 95% must end so
   (exit 1 otherwise); each request's output length is kept.
2. unconstrained: the same prompts, each with max_tokens = its constrained length and
   ignore_eos, so both runs produce the same number of tokens per request; timed.

Both runs are timed --repeat times (3), alternating; the fastest of each counts. Every
repeat's answers must validate too; how many differ from the first run's is reported, not
required to be 0: later repeats find the prompts in the prefix cache, so in bf16 their
prefill rounds differently and a greedy row may take the other side of a near-tie. Prints output tok/s of both, their ratio
(the cost of the constraint), and the host time of the constrained runs' grammar work
per step: filling masks (StructuredOutputs.bitmask, also per token), the runner's masking
(ModelRunner._constrain: fill, upload, apply; on the CPU the apply is computed there) and
feeding tokens to the matchers (EngineCore._advance_grammars). `--small --n 64` measures
those at a larger batch on the CPU. A warm-up on other prompts compiles the schema and
captures the graphs first. Writes structured_outputs.json into --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "married"],
    "additionalProperties": False,
}
FIRST = "Maria Tom Aiko Kwame Ingrid Raj Lena Omar Chen Sofia Diego Amara Ivan Noor".split()
LAST = "Lopez Berg Tanaka Mensah Patel Novak Haddad Wei Rossi Silva Okafor Petrov".split()
CITIES = "Madrid Boston Kyoto Accra Oslo Mumbai Prague Cairo Lima Turin Lagos Kazan".split()
JOBS = "teacher nurse baker pilot chemist carpenter lawyer farmer editor dentist".split()
FORMS = [
    "{name} is {age}, works as a {job} in {city} and is {status}.",
    "Meet {name} ({age}), a {status} {job} from {city}.",
    "{city}'s best-known {job}, {name}, turned {age} this year; {status}.",
]


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sentence = rng.choice(FORMS).format(
            name=f"{rng.choice(FIRST)} {rng.choice(LAST)}",
            age=rng.randint(18, 90),
            job=rng.choice(JOBS),
            city=rng.choice(CITIES),
            status=rng.choice(["married", "single"]),
        )
        ask = "Extract the person's name, age, city, occupation and whether they are married"
        out.append([{"role": "user", "content": f"{ask} as JSON.\n{sentence}"}])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--n", type=int, default=None, help="requests (256; 4 with --small)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--small", action="store_true", help="CPU: 4 requests, max_tokens 96")
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="timed runs of each kind, alternating; the fastest of each counts (3; 1 --small)",
    )
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    import jsonschema
    import torch

    from batchgen import LLM, SamplingParams, StructuredOutputsParams

    n, max_tokens = (4, 96) if args.small else (256, args.max_tokens)
    n = args.n or n
    kw = dict(max_model_len=1024)
    if args.small or not torch.cuda.is_available():
        kw.update(device="cpu", dtype="float32", max_num_batched_tokens=512)
    llm = LLM(model=args.model, **kw)
    engine = llm.engine
    spec = StructuredOutputsParams(json=SCHEMA)
    bound = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
    warm = 1 if args.small else 8
    llm.chat(conversations(warm, seed=1), bound, use_tqdm=False)  # compile, capture graphs

    fills: list[float] = []
    constrains: list[float] = []
    advances: list[float] = []
    timed = [
        (engine.grammar, "bitmask", fills),
        (engine.runner, "_constrain", constrains),
        (engine, "_advance_grammars", advances),
    ]
    for owner, name, times in timed:
        setattr(owner, name, _timed(getattr(owner, name), times))
    convs = conversations(n, seed=0)
    repeat = args.repeat or (1 if args.small else 3)
    steps0 = engine.stats.steps
    t0 = time.perf_counter()
    outs = llm.chat(convs, bound, use_tqdm=False)
    constrained_s = time.perf_counter() - t0
    steps = engine.stats.steps - steps0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    stopped, bad = ended_and_invalid(outs, jsonschema)

    free = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    free_s, differing = float("inf"), 0
    for i in range(repeat):  # alternating, so drift on the machine hits both alike
        if i:
            t0 = time.perf_counter()
            again = llm.chat(convs, bound, use_tqdm=False)
            constrained_s = min(constrained_s, time.perf_counter() - t0)
            bad += ended_and_invalid(again, jsonschema)[1]
            first = output_ids(outs)
            differing = max(differing, sum(a != b for a, b in zip(output_ids(again), first)))
        t0 = time.perf_counter()
        free_outs = llm.chat(convs, free, use_tqdm=False)
        free_s = min(free_s, time.perf_counter() - t0)
    for owner, name, _ in timed:
        delattr(owner, name)  # the class's method again
    free_tokens = sum(len(o.outputs[0].token_ids) for o in free_outs)

    tokens = sum(lengths)
    result = {
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "requests": n,
        "output_tokens": tokens,
        "unconstrained_output_tokens": free_tokens,
        "ended_by_eos": stopped,
        "invalid": bad,
        "constrained_tok_s": tokens / constrained_s,
        "unconstrained_tok_s": free_tokens / free_s,
        "constrained_s": constrained_s,
        "unconstrained_s": free_s,
        "repeat": repeat,
        "repeat_rows_differing": differing,
        "steps": steps,
        "mask_fill_ms_per_step": 1e3 * sum(fills) / max(len(fills), 1),
        "mask_fill_us_per_token": 1e6 * sum(fills) / repeat / max(tokens, 1),
        "constrain_ms_per_step": 1e3 * sum(constrains) / max(len(constrains), 1),
        "advance_ms_per_step": 1e3 * sum(advances) / max(len(advances), 1),
        "sample": outs[0].outputs[0].text,
    }
    result["throughput_ratio"] = result["constrained_tok_s"] / result["unconstrained_tok_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_outputs.json").write_text(json.dumps(result, indent=2))
    print(
        f"{n} requests, {tokens} output tokens: constrained {result['constrained_tok_s']:,.0f} "
        f"tok/s, unconstrained {result['unconstrained_tok_s']:,.0f} tok/s "
        f"(ratio {result['throughput_ratio']:.3f}); mask fill "
        f"{result['mask_fill_ms_per_step']:.2f} ms/step, "
        f"{result['mask_fill_us_per_token']:.1f} us/token over {steps} steps; masking "
        f"{result['constrain_ms_per_step']:.2f} ms/step, advancing matchers "
        f"{result['advance_ms_per_step']:.2f} ms/step; "
        f"{stopped}/{n} ended by EOS, {bad} invalid (all runs); {differing} rows of a "
        "repeat differ from the first run"
    )
    print("first answer:", result["sample"])
    ok = bad == 0 and stopped >= 0.95 * n and free_tokens == tokens
    return 0 if ok else 1


def ended_and_invalid(outs, jsonschema) -> tuple[int, int]:
    """(answers that ended by EOS, how many of those fail to parse or validate)."""
    stopped = bad = 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    return stopped, bad


def output_ids(outs) -> list[list[int]]:
    """Each request's output token ids."""
    return [o.outputs[0].token_ids for o in outs]


def _timed(method, times: list[float]):
    """`method`, appending the seconds of each call to `times`."""

    def timed(*args):
        t = time.perf_counter()
        out = method(*args)
        times.append(time.perf_counter() - t)
        return out

    return timed


if __name__ == "__main__":
    sys.exit(main())
