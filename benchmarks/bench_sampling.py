"""The sampler on the GPU at W1's vocabulary (Qwen3, 151,936 tokens), bf16 logits.

For 1, 64 and 256 rows: the batch kernels alone (kernels/sampling.py's draw,
kernels/sampling_cut.py's nucleus), the whole Sampler call per configuration (greedy;
temperature 0.8 + top_p 0.95 with a seed a row; + top_k 50), and beside them the
former path in the same process: a full-vocabulary sort for top_k/top_p and one seeded
torch.Generator and exponential_ launch a row. Times are triton.testing.do_bench
medians in microseconds (on the CPU, for a check that the script runs: the median of
five calls, kernels under TRITON_INTERPRET=1).

    python3 -m benchmarks.bench_sampling
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_sampling --device cpu --vocab 500 --rows 1 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from triton.testing import do_bench

from batchgen.kernels.sampling import sample_tokens
from batchgen.kernels.sampling_cut import top_p_cut
from batchgen.runner.sampler import Sampler, SamplingMetadata, request_seed
from batchgen.sampling_params import SamplingParams

VOCAB = 151_936


def former_path(logits: torch.Tensor, temperature, top_k: int, top_p: float, seeds) -> None:
    """What the sampler did before: sort, mask, softmax, a generator and a launch a row."""
    x = logits.float() / temperature
    s, order = x.sort(dim=-1)
    if top_k:
        kth = s[:, -top_k].unsqueeze(1)
        s.masked_fill_(s < kth, float("-inf"))
    cum = s.softmax(dim=-1).cumsum(dim=-1)
    s.masked_fill_(cum <= 1 - top_p, float("-inf"))
    probs = torch.empty_like(x).scatter_(1, order, s).softmax(dim=-1)
    q = torch.empty_like(probs)
    for i, seed in enumerate(seeds):
        g = torch.Generator(device=logits.device).manual_seed(seed)
        q[i].exponential_(generator=g)
    probs.div_(q).argmax(dim=-1)


def timed_us(fn, device: torch.device) -> float:
    if device.type == "cuda":
        return do_bench(fn) * 1000
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    args = ap.parse_args(argv)
    dev, vocab = torch.device(args.device), args.vocab
    sampler = Sampler(kernels=True)
    print(f"{'rows':>5} {'what':<34} {'us':>9}")
    for rows in args.rows:
        bench_rows(rows, vocab, dev, sampler)


def bench_rows(rows: int, vocab: int, dev: torch.device, sampler: Sampler) -> None:
    """Every timing of one batch size, printed as it comes."""
    logits = torch.randn(rows, vocab, device=dev).to(torch.bfloat16)
    seeds = [request_seed(0, i) for i in range(rows)]
    temp = torch.full((rows,), 0.8, device=dev)
    seed_t = torch.tensor(seeds, device=dev)
    pos = torch.zeros(rows, dtype=torch.int64, device=dev)
    cut = torch.full((rows,), float("-inf"), device=dev)
    top_p = torch.full((rows,), 0.95, device=dev)
    timings = {
        "kernel: draw": lambda: sample_tokens(logits, temp, seed_t, pos),
        "kernel: nucleus cut": lambda: top_p_cut(logits, temp, top_p, cut),
    }
    configs = {
        "greedy": SamplingParams(temperature=0.0),
        "T 0.8, top_p 0.95, seeded": SamplingParams(temperature=0.8, top_p=0.95),
        "+ top_k 50": SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
    }
    for name, p in configs.items():
        meta = SamplingMetadata.build(
            [p] * rows, [[]] * rows, [[]] * rows, vocab, dev, [0], seeds=seeds
        )
        timings[f"Sampler: {name}"] = lambda meta=meta: sampler(logits, meta)
    timings["former: T 0.8, top_p 0.95, seeded"] = lambda: former_path(logits, 0.8, 0, 0.95, seeds)
    timings["former: + top_k 50"] = lambda: former_path(logits, 0.8, 50, 0.95, seeds)
    for name, fn in timings.items():
        print(f"{rows:>5} {name:<34} {timed_us(fn, dev):>9.1f}", flush=True)


if __name__ == "__main__":
    main()
