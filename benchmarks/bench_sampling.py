"""The sampler on the GPU at W1's shape: Qwen3's 151,936-token vocabulary, bf16 logits.

For each row count (default 128, 256 and 1,024: W1 decodes 256 rows tapering to a few,
W7 ~1,000), the kernels alone (kernels/sampling.py's draw, kernels/sampling_nucleus.py's
top-p draw, kernels/penalties.py) and the whole Sampler call for W1's configurations
beside greedy (the runner's plain greedy argmax): temperature 0.8 + top_p 0.95 with a
seed a row, + top_k 50, + repetition_penalty 1.1 (counts kept on the device, 64 output
tokens a row). GPU times are triton.testing.do_bench medians in microseconds; each
Sampler line also says how far it is over greedy; each graph line is the same step's
sampling as a decode graph runs it (runner/graph_sampling.py: sample_static captured in a
CUDA graph, replayed), with the host time of its static words. Host lines: milliseconds of CPU to
build a step's metadata, afresh (SamplingMetadata.build) and from a kept SamplingState.
On the CPU (a check that it runs) times are medians of five calls, kernels interpreted.

    python3 -m benchmarks.bench_sampling
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_sampling --device cpu --vocab 500 --rows 4

Names a tree lacks (SamplingState, kernels.penalties, kernels.sampling_nucleus) are
skipped, so the same file times an older checkout for comparison.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from triton.testing import do_bench

from batchgen.kernels.sampling import sample_tokens
from batchgen.runner import sampler as sampler_module
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.sampler import Sampler, SamplingMetadata, request_seed
from batchgen.sampling_params import SamplingParams

VOCAB = 151_936
CONFIGS = {
    "sampled": dict(temperature=0.8, top_p=0.95),
    "top_k": dict(temperature=0.8, top_p=0.95, top_k=50),
    "penalty": dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1),
}


def timed_us(fn, device: torch.device) -> float:
    if device.type == "cuda":
        return do_bench(fn) * 1000
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def host_ms(fn, repeat: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 1024])
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    print(f"{'rows':>5} {'what':<40} {'value':>10}")
    for rows in args.rows:
        bench_rows(rows, args.vocab, dev)


def show(rows: int, what: str, value: float, unit: str) -> None:
    print(f"{rows:>5} {what:<40} {value:>10.1f} {unit}", flush=True)


def bench_rows(rows: int, vocab: int, dev: torch.device) -> None:
    """Every timing of one batch size, printed as it comes."""
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(torch.bfloat16).to(dev)
    seeds = [request_seed(0, i) for i in range(rows)]
    temp = torch.full((rows,), 0.8, device=dev)
    seed_t = torch.tensor(seeds, device=dev)
    pos = torch.zeros(rows, dtype=torch.int64, device=dev)
    top_p = torch.full((rows,), 0.95, device=dev)
    show(
        rows, "kernel: draw", timed_us(lambda: sample_tokens(logits, temp, seed_t, pos), dev), "us"
    )
    try:
        nucleus = importlib.import_module("batchgen.kernels.sampling_nucleus")
        show(rows, "kernel: nucleus draw (draw and check)", timed_us(
            lambda: nucleus.sample_nucleus(logits, temp, seed_t, pos, top_p), dev
        ), "us")  # fmt: skip
    except ImportError:
        pass
    try:
        penalties = importlib.import_module("batchgen.kernels.penalties")
    except ImportError:
        penalties = None
    counts = torch.randint(0, 2, (rows, vocab), dtype=torch.int32, generator=gen).to(dev)
    if penalties is not None:
        rep = torch.full((rows,), 1.1, device=dev)
        zero = torch.zeros(rows, device=dev)
        show(rows, "kernel: penalties", timed_us(
            lambda: penalties.penalized_logits(logits, counts, None, rep, zero, zero), dev
        ), "us")  # fmt: skip
    sampler = Sampler(kernels=dev.type == "cuda" or None)
    greedy = timed_us(lambda: logits.argmax(dim=-1), dev)
    show(rows, "greedy: argmax (the runner's plain greedy)", greedy, "us")
    ids = [f"r{i}" for i in range(rows)]
    prompts = [[i % vocab] * 32 for i in range(rows)]
    outputs = [[(i * 7 + k) % vocab for k in range(64)] for i in range(rows)]
    steps = [len(o) for o in outputs]
    for name, kw in CONFIGS.items():
        params = [SamplingParams(seed=i, **kw) for i in range(rows)]
        kept = PenaltyCounts(vocab, dev)
        build = dict(seeds=seeds, penalty_counts=kept, request_ids=ids)
        meta = SamplingMetadata.build(params, prompts, outputs, vocab, dev, [0], **build)
        t = timed_us(lambda meta=meta: sampler(logits, meta), dev)
        show(rows, f"Sampler: {name}", t, f"us ({t - greedy:+.1f} over greedy)")
        fresh = host_ms(
            lambda p=params, b=build: SamplingMetadata.build(
                p, prompts, outputs, vocab, dev, [0], **b
            )
        )
        show(rows, f"host: {name} metadata, afresh", fresh * 1e3, "us")
        state_cls = getattr(sampler_module, "SamplingState", None)
        if state_cls is not None:
            state = state_cls(vocab, dev, [0], penalty_counts=kept)
            kept_ms = host_ms(
                lambda p=params, s=state: s.build(ids, p, prompts, outputs, steps, seeds)
            )
            show(rows, f"host: {name} metadata, kept state", kept_ms * 1e3, "us")
            args = (ids, params, prompts, outputs, steps, seeds)
            graph = graph_sampling(
                logits, state_cls(vocab, dev, [0], None, PenaltyCounts(vocab, dev)), args
            )
            if graph is not None:
                t, host = graph
                show(
                    rows,
                    f"graph: {name} sample_static replayed",
                    t,
                    f"us ({t - greedy:+.1f} over greedy)",
                )
                show(rows, f"host: {name} graph words (columns, pack)", host * 1e3, "us")


def graph_sampling(logits, state, args):
    """(us, host ms): the decode graph's sampler (runner/graph_sampling.py) on these
    rows captured in a CUDA graph and replayed (on the CPU: called eagerly, torch
    references), and the host time of its step words; None where the tree lacks it."""
    try:
        gs = importlib.import_module("batchgen.runner.graph_sampling")
    except ImportError:
        return None
    rows, dev = logits.shape[0], logits.device
    cols = state.columns(*args)
    variant = gs.variant_of(cols, logits.shape[1])
    words = torch.from_numpy(gs.pack(cols, rows)).to(dev)
    view = gs.StaticColumns.view(words, rows)
    host = host_ms(lambda: gs.pack(state.columns(*args), rows))
    kept, cuda = state.penalty_counts, dev.type == "cuda"

    def draw():
        return gs.sample_static(logits, view, variant, kept, kernels=cuda)

    if not cuda:
        return timed_us(draw, dev), host
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        draw()  # compiles, allocates
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            draw()
    torch.cuda.current_stream().wait_stream(stream)
    return timed_us(graph.replay, dev), host


if __name__ == "__main__":
    main()
