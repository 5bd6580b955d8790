"""One entry point per workload of BENCHMARKS.md, from the repository root:

    PYTHONPATH=src python3 -m benchmarks                 # lists them
    PYTHONPATH=src python3 -m benchmarks w1 --out DIR    # W1, its peer beside it
    PYTHONPATH=src python3 -m benchmarks w4 --small --out /tmp/w4   # any script's options

Each name runs its module's main() with the options that make it the workload, then the
options given; `python3 -m benchmarks.<module>` runs a module with none of them.
"""

from __future__ import annotations

import importlib
import sys

# name: (module, the options that make it the workload, what it measures)
WORKLOADS = {
    "w1": ("throughput", [], "W1 nano: Qwen3-0.6B shape, 256 requests, vs transformers CB"),
    "w1-sampled": ("throughput", ["--sampling", "all"], "W1 sampled, top_k, penalty vs greedy"),
    "w2": ("pressure", [], "W2 pressure on W1's model: host tier on vs off"),
    "w2-8b": ("pressure", ["--model", "llama-3.1-8b"], "W2 on Llama-3.1-8B's shape"),
    "w3": ("shared_prefix", [], "W3 shared-prefix on W1's model: its four runs"),
    "w3-8b": ("shared_prefix", ["--model", "llama-3.1-8b"], "W3 on Llama-3.1-8B's shape"),
    "w4": ("mla", [], "W4 mla: Moonlight-shaped DeepSeek-V3, vs transformers generate()"),
    "w5": ("tp_scaling", [], "W5 tp2: Llama-3.1-8B shape, TP=1 vs TP=2"),
    "w6": ("hybrid", [], "W6 hybrid: Kimi-Linear shape, vs transformers generate()"),
    "w7": ("chat_job", [], "W7 chat-job: batchgen run beside LLM.chat, sampled and greedy"),
    "w8": ("dp_ep", [], "W8 dp-ep: attention DP + EP vs TP vs N engines, W4/W6 models"),
    "dp-one": ("dp_one", [], "W4/W6 models on one GPU: plain engine vs DP=1/EP=1, same run"),
    "precision": ("precision", [], "memory, tok/s by precision: --model w4|w6 weights, w1 KV"),
    "invariance": ("invariance", [], "deterministic=True: 512-row probe batched 3 ways + cost"),
    "startup": ("startup", [], "first start: seconds from LLM(...) to ready, by phase"),
    "kernels": ("bench_kernels", [], "the Triton kernels against the card's ceilings"),
    "sampling": ("bench_sampling", [], "the sampler's kernels and paths, microseconds"),
    "ceilings": ("card", [], "the card's copy, matmul and host-copy ceilings, measured"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in WORKLOADS:
        lines = [
            f"  {name:<11} {what}  (benchmarks.{mod})" for name, (mod, _, what) in WORKLOADS.items()
        ]
        sys.stdout.write("python3 -m benchmarks NAME [options]:\n" + "\n".join(lines) + "\n")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, preset, _ = WORKLOADS[argv[0]]
    return importlib.import_module(f"benchmarks.{module}").main(preset + argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
