"""Memory and tok/s by precision (issue 51): one model's shape in bf16, FP8 and INT4 weights,
or W1 with FP8 KV beside bf16 KV, in one process.

    PYTHONPATH=src python3 -m benchmarks precision --model w4 --out $OUT   # W4: bf16, FP8, INT4
    PYTHONPATH=src python3 -m benchmarks precision --model w6 --out $OUT   # W6: the same
    PYTHONPATH=src python3 -m benchmarks precision --model w1 --out $OUT   # W1: FP8 KV, bf16 KV
    PYTHONPATH=src python3 -m benchmarks precision --model w1 --profile --out $OUT  # + profiles
    PYTHONPATH=src python3 -m benchmarks precision --model w4 --small --out /tmp/p  # CPU, CI

Models: --model w4 is W4's (workloads.MOONLIGHT_W4), w6 W6's (KIMI_W6), w1 W1's
(QWEN3_0_6B); random weights drawn on the device from config.json alone
(load_format="dummy", which gives quantized layers random quantized weights), the same
loader path a checkpoint takes from the quantization plan on (the layers' quantized
parameters, their kernels, the memory plan over their real bytes); only the reading of
the tensors from disk is left out. W4 and W6 run three engines, one after the other:

- `fp8`: quantization="fp8" (block-scaled FP8, 128 x 128 blocks, as DeepSeek-V3 ships:
  every quantizable linear and the routed experts; MLA's kv_b_proj, the router and the
  lm_head stay in bf16);
- `int4`: the config with Kimi-K2-Thinking's quantization_config (workloads.INT4_EXPERTS:
  compressed-tensors pack-quantized, symmetric, groups of 32, the routed experts only);
- `bf16`: the plain model.

Each engine, after an untimed warm-up: its weight bytes on the device
(metrics()["weight_bytes"]) and KV pages; a decode-bound run (--rows requests of 16
random tokens, 128 output tokens each, greedy, ignore_eos: the decode phase's tok/s); the
workload's requests end to end (W4 and W6: workloads.w4_requests, 512 x 1024 tokens, 128
out; W1: workloads.w1_requests), output tok/s; and a closeness probe (64 prompts of 32
tokens, 32 greedy tokens, five logprobs a step). The quantized engines' weights are then
dequantized into bf16 on the host, and after the bf16 engine's own runs each is loaded in
turn into its model (in place: the same CUDA graphs) and the probe runs again: the
quantized engine against the dequantized-bf16 model on the same weights (this checks the
kernels, not the quantization) by the logprob-closeness rule (eval/closeness.py), with
the share of tokens that agree and the largest logprob difference before a row's first
differing token. W1: `fp8 KV` (kv_cache_dtype="fp8") and `bf16 KV` engines with the
same random bf16 weights, FP8 KV's probe against bf16 KV's.

Prints the markdown table "memory and tok/s by precision" (ratios to bf16 / bf16 KV),
then "phases": each engine's end-to-end run split at the step after which every request
had its first token (the prefill phase's seconds and steps, the decode phase's tok/s),
its slowest steps and the Triton specializations it met mid-run (compiled there, or
read from Triton's disk cache: a warm-up that missed one costs the run its compile), and
writes precision-<model>.json into --out. --small: CPU-sized configs of the same kinds
(routed experts 128 wide, so FP8 holds them too), in float32.

--profile (about 30 s more an engine on an H100 for W1) adds, for each engine after its
timed runs: the workload end to end once more with every prompt's first token changed
(`e2e_again`: no page hits the cache, every kernel is compiled: a cost that is gone the
second time was a one-off), and profiles.profile_prefill (prefill steps of the
workload's prompts, kernels by family) and profiles.profile_decode (decode steps of the
workload's requests at their own contexts, unlike the decode-bound run's 16 to 144
tokens); the profiles go to precision-<model>-profile.json and their kernels by family
to the table "GPU ms a step by kernel family" (empty on the CPU). Its decode requests
need the longest prompt + 300 tokens of context: max_model_len grows to that where it
was less (W4 and W6: 1,168 -> 1,340; W1 keeps its 2,064).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.engine_runs import (
    add_engine_args,
    built_engine,
    comma_list,
    engine_kwargs,
    size,
)
from benchmarks.moe_runs import release_device_memory, warm_up_prompts
from benchmarks.precision_runs import (
    closeness_of,
    dequantized_state,
    load_state,
    probe,
    timed,
)
from benchmarks.workloads import (
    KIMI_W6,
    MOONLIGHT_W4,
    QWEN3_0_6B,
    SMALL_KIMI,
    SMALL_MODEL,
    SMALL_MOONLIGHT,
    config_dir,
    small_requests,
    w1_requests,
    w4_requests,
    with_int4_experts,
)

# --model: (config, its CPU-sized version, the largest random token id of its prompts)
MODELS = {
    "w4": (MOONLIGHT_W4, dict(SMALL_MOONLIGHT, moe_intermediate_size=128), 100000),
    "w6": (KIMI_W6, dict(SMALL_KIMI, moe_intermediate_size=128), 100000),
    "w1": (QWEN3_0_6B, SMALL_MODEL, 10000),
}


def variants(model: str, config: dict, only=None) -> list[tuple[str, dict, dict]]:
    """(name, config, engine options) of the engines a --model runs, in the order they
    run; the last is the reference the others are compared with, which runs whatever
    `only` (names of the others, None: all) keeps."""
    if model == "w1":
        runs = [("fp8 KV", config, {"kv_cache_dtype": "fp8"}), ("bf16 KV", config, {})]
    else:
        runs = [
            ("fp8", config, {"quantization": "fp8"}),
            ("int4", with_int4_experts(config), {}),
            ("bf16", config, {}),
        ]
    return [r for r in runs[:-1] if only is None or r[0] in only] + runs[-1:]


class Plan:
    """The requests of one --model's runs (--small: CPU-sized)."""

    def __init__(
        self,
        model: str,
        small: bool,
        rows: int,
        requests: int | None = None,
        profile: bool = False,
    ):
        _, _, top = MODELS[model]
        top = 500 if small else top
        self.top = top
        if model == "w1":
            self.workload = small_requests() if small else w1_requests()
        elif small:
            self.workload = w4_requests(n=6, prompt_len=24, out_len=6, max_token=top)
        else:
            self.workload = w4_requests()
        if requests:
            self.workload = (self.workload[0][:requests], self.workload[1][:requests])
        self.rows = rows
        self.decode_len, self.decode_out = (8, 8) if small else (16, 128)
        self.probe_rows, self.probe_len, self.probe_out = (6, 12, 8) if small else (64, 32, 32)
        # --profile's decode steps: each request's output cap (0: no profile)
        self.profile_out = (64 if small else 300) if profile else 0

    def random_prompts(self, n: int, length: int, first: int, seed: int) -> list[list[int]]:
        """n prompts of `length` random tokens, each starting with `first` (prompts of
        different runs on one engine share no cached page)."""
        rng = random.Random(seed)
        return [[first] + [rng.randint(3, self.top) for _ in range(length - 1)] for _ in range(n)]

    def decode_prompts(self) -> list[list[int]]:
        return self.random_prompts(self.rows, self.decode_len, 3, seed=1)

    def probe_prompts(self, k: int) -> list[list[int]]:
        """The probe of the k-th variant: its own first token, the same rest."""
        return self.random_prompts(self.probe_rows, self.probe_len, 10 + k, seed=2)

    def max_model_len(self) -> int:
        prompts, outs = self.workload
        longest = max(map(len, prompts))
        runs = (longest + max(outs), self.decode_len + self.decode_out, longest + self.profile_out)
        return max(runs) + 16


def fresh(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts with their first token two higher (every first token here is far
    below the vocabulary's size), so none of their pages is cached: neither the
    workload's own, nor those of profiles.fresh_prompts (one lower, one higher from 0),
    which --profile's prefill profile takes after `e2e_again`, whose pages it must not
    meet (a first token one lower both ways let the profile read its prompts from the
    cache e2e_again left)."""
    return [[p[0] + 2, *p[1:]] for p in prompts]


def measure(llm, plan: Plan, again: bool = False) -> dict:
    """Weight bytes, KV pages, and the decode-bound and end-to-end runs, after a warm-up
    shaped like both (first prompts of the workload reversed; the decode rows); with
    `again`, the end-to-end run once more on fresh() prompts (`e2e_again`)."""
    from batchgen import SamplingParams

    prompts, outs = plan.workload
    warm = [p[::-1] for p in prompts[: warm_up_prompts(llm, len(prompts[0]))]]
    warm_params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate(warm, warm_params, use_tqdm=False)
    warm_rows = [[4, *p[1:]] for p in plan.decode_prompts()]
    llm.generate(warm_rows, warm_params, use_tqdm=False)
    eng = llm.engine
    decode = timed(llm, plan.decode_prompts(), [plan.decode_out] * plan.rows, "decode")
    e2e = timed(llm, prompts, outs, "e2e")
    result = {
        "weight_bytes": eng.metrics()["weight_bytes"],
        "kv_pages": eng.kv.allocator.num_pages,
        "page_size": eng.config.page_size,
        "decode": decode,
        "e2e": e2e,
    }
    if again:
        result["e2e_again"] = timed(llm, fresh(prompts), outs, "again")
    return result


def profile(llm, plan: Plan, args) -> dict:
    """--profile's profiles of one engine: profiles.profile_prefill over the workload's
    prompts, profiles.profile_decode over its requests (as many as max_num_seqs, each
    capped at plan.profile_out tokens: 300, W1's own profile)."""
    from benchmarks.profiles import profile_decode, profile_prefill

    prompts, _ = plan.workload
    return {
        "prefill": profile_prefill(llm, prompts),
        "decode": profile_decode(llm, prompts, args, max_tokens=plan.profile_out),
    }


def progress(name: str, run: dict) -> None:
    """One engine's figures on stderr as it finishes (a run cut off by a time limit
    keeps what it had)."""
    sys.stderr.write(
        f"{name}: built in {run['build_s']:.1f} s, all in {run['seconds']:.1f} s; weights "
        f"{size(run['weight_bytes'])}, {run['kv_pages']} KV pages, decode "
        f"{run['decode']['decode_tok_s']:.0f} tok/s, e2e {run['e2e']['tok_s']:.0f} tok/s "
        f"(prefill phase {run['e2e']['prefill_phase_s']:.2f} s, "
        f"{len(run['e2e']['compiles'])} kernels met mid-run)\n"
    )
    sys.stderr.flush()


def run_model(args, plan: Plan) -> dict:
    """Every variant of --model measured; each one but the reference with its closeness
    to the reference on the same weights."""
    import torch

    full, small, _ = MODELS[args.model]
    dtype = "float32" if args.small else "bfloat16"
    runs = variants(args.model, small if args.small else full, args.only)
    base = args.ckpt or Path(f"/tmp/batchgen-precision-{args.model}")
    if args.small:
        base = base.with_name(base.name + "-small")
    common = dict(
        dtype=dtype,
        device=args.device,
        load_format="dummy",
        max_model_len=plan.max_model_len(),
        **engine_kwargs(args),
    )
    if common["max_num_seqs"] is None:
        common["max_num_seqs"] = plan.rows
    results: dict[str, dict] = {}
    probes, states, profiles = {}, {}, {}
    weights = args.model != "w1"  # quantized weights, compared through their dequantized form
    *others, (ref_name, _, _) = runs
    for k, (name, config, kw) in enumerate(runs):
        ckpt = config_dir(base / name.replace(" ", "-"), config, dtype)
        started = time.perf_counter()
        with built_engine(ckpt, **common, **kw) as llm:
            built = time.perf_counter()
            results[name] = measure(llm, plan, again=args.profile)
            if args.profile:
                profiles[name] = profile(llm, plan, args)
            model = llm.engine.model
            if name != ref_name:
                probes[name] = probe(llm, plan.probe_prompts(k), plan.probe_out)
                if weights:
                    states[name] = dequantized_state(model, getattr(torch, dtype))
            for j, (other, _, _) in enumerate(others if name == ref_name else []):
                if weights:
                    load_state(model, states.pop(other))
                ref = probe(llm, plan.probe_prompts(j), plan.probe_out)
                results[other]["closeness"] = closeness_of(probes[other], ref)
            results[name]["build_s"] = built - started
            results[name]["seconds"] = time.perf_counter() - started
            progress(name, results[name])
            llm.engine.shutdown()
            del llm, model
        release_device_memory()
    out = {"reference": ref_name, "runs": {name: results[name] for name, _, _ in runs}}
    if args.profile:
        out["profiles"] = {name: profiles[name] for name, _, _ in runs}
    return out


def table(model: str, result: dict, small: bool) -> str:
    """The markdown table "memory and tok/s by precision" of run_model's result."""
    ref = result["runs"][result["reference"]]
    lines = [
        f"memory and tok/s by precision ({model}{', small, CPU' if small else ''})",
        "",
        "| precision | weights | x ref | KV pages | decode tok/s | x ref | e2e tok/s | "
        "x ref | tokens agree | max logprob diff | collapsed rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        close = run.get("closeness")
        judged = (
            f"{100 * close['token_agreement']:.1f}% | {close['max_logprob_diff']:.3g} | "
            f"{close['collapsed_rows']}/{close['rows']}"
            if close
            else "reference | | "
        )
        lines.append(
            f"| {name} | {size(run['weight_bytes'])} | "
            f"{run['weight_bytes'] / ref['weight_bytes']:.2f} | {run['kv_pages']} | "
            f"{run['decode']['decode_tok_s']:.0f} | "
            f"{run['decode']['decode_tok_s'] / ref['decode']['decode_tok_s']:.2f} | "
            f"{run['e2e']['tok_s']:.0f} | {run['e2e']['tok_s'] / ref['e2e']['tok_s']:.2f} | "
            f"{judged} |"
        )
    return "\n".join(lines)


def phase_table(result: dict) -> str:
    """The markdown table "phases" of run_model's result: each engine's end-to-end run
    (and e2e_again, with --profile) split into its prefill phase (seconds, steps) and
    decode phase (tok/s), the specializations it met mid-run, and its slowest step."""
    lines = [
        "phases (end to end: prefill phase until every request has its first token)",
        "",
        "| precision | run | tok/s | prefill phase s | prefill steps | decode phase tok/s | "
        "steps | kernels met mid-run | slowest step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        for key in ("e2e", "e2e_again"):
            r = run.get(key)
            if r is None:
                continue
            lines.append(
                f"| {name} | {key} | {r['tok_s']:.0f} | {r['prefill_phase_s']:.3f} | "
                f"{r['prefill_phase_steps']} | {r['decode_tok_s']:.0f} | {r['steps']} | "
                f"{len(r['compiles'])} | {(r['slowest_steps'] or ['-'])[0]} |"
            )
    return "\n".join(lines)


def family_table(profiles: dict) -> str:
    """The markdown table "GPU ms a step by kernel family" of --profile's profiles: a
    row an engine and phase (prefill, decode), with the step's wall ms."""
    from benchmarks.profiles import FAMILIES

    families = [name for name, _ in FAMILIES] + ["other"]
    lines = [
        "GPU ms a step by kernel family (--profile)",
        "",
        "| precision | phase | step wall ms | " + " | ".join(families) + " |",
        "|---|---|---|" + "---|" * len(families),
    ]
    for name, prof in profiles.items():
        for phase in ("prefill", "decode"):
            p = prof[phase]
            fam = p["gpu_ms_by_family"]
            cells = " | ".join(f"{fam[f]:.3f}" if f in fam else "-" for f in families)
            lines.append(f"| {name} | {phase} | {p['step_wall_ms']:.2f} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="w4")
    ap.add_argument("--small", action="store_true", help="tiny configs on the CPU")
    ap.add_argument(
        "--rows", type=int, default=None, help="the decode run's requests (512; --small: 8)"
    )
    ap.add_argument(
        "--only",
        type=lambda text: comma_list(text, ("fp8", "int4", "fp8 KV"), "fp8, int4 or 'fp8 KV'"),
        default=None,
        help="of the engines compared with the reference, only these (comma-separated; "
        "default: all); the reference (bf16, bf16 KV) always runs",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="end to end on the workload's first N requests only (default: all)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="+ each engine's end-to-end run again and its prefill and decode steps "
        "profiled (precision-<model>-profile.json)",
    )
    add_engine_args(ap)
    ap.set_defaults(ckpt=None)
    args = ap.parse_args(argv)
    args.device = "cpu" if args.small else "cuda"
    rows = args.rows or (8 if args.small else 512)
    plan = Plan(args.model, args.small, rows, args.requests, args.profile)
    result = run_model(args, plan)
    result.update(model=args.model, small=args.small, rows=plan.rows)
    args.out.mkdir(parents=True, exist_ok=True)
    profiles = result.pop("profiles", None)
    (args.out / f"precision-{args.model}.json").write_text(json.dumps(result, indent=2))
    sys.stdout.write(table(args.model, result, args.small) + "\n\n")
    sys.stdout.write(phase_table(result) + "\n")
    if profiles is not None:
        path = args.out / f"precision-{args.model}-profile.json"
        path.write_text(json.dumps(profiles, indent=2))
        sys.stdout.write("\n" + family_table(profiles) + "\n")
    want = sum(plan.workload[1])
    runs = [r[key] for r in result["runs"].values() for key in ("e2e", "e2e_again") if key in r]
    return 0 if all(r["output_tokens"] == want for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
