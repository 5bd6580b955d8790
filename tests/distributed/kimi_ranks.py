"""The engine arguments, prompts and sampling mix the multi-rank Kimi Linear tests (tensor
parallel, attention data parallel over processes or Ray actors) run a tiny random
checkpoint with, beside one process."""

from __future__ import annotations

import random

from batchgen import SamplingParams

KW = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_model_len=192,
    max_num_seqs=8,
    max_num_batched_tokens=32,  # prefills chunked across steps, beside decodes
)


def kimi_prompts() -> list[list[int]]:
    """Six prompts: a shared 16-token head (four pages: a state checkpoint at 16 serves
    it), then tails of 60, 5, 90, 21, 48 and 1 tokens, taking some past one KDA chunk
    (64)."""
    rng = random.Random(0)
    head = [rng.randint(3, 500) for _ in range(16)]
    return [head + [rng.randint(3, 500) for _ in range(n)] for n in (60, 5, 90, 21, 48, 1)]


def kimi_params(logprobs: int | None = None) -> list[SamplingParams]:
    """One for each of kimi_prompts(): greedy, seeded sampled and unseeded sampled rows
    (the engine seeds those by arrival) in turn, of 12 tokens, each asking `logprobs`
    where given."""
    kinds = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=logprobs),
        SamplingParams(temperature=0.8, max_tokens=12, seed=3, logprobs=logprobs),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=12, logprobs=logprobs),
    ]
    return [kinds[i % 3] for i in range(len(kimi_prompts()))]
