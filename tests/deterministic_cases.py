"""The workload the deterministic=True engine tests share: prompts of mixed lengths, a
prefix shared by every fourth, greedy and seeded sampled rows, and each probed prompt's
row (tokens, finish reason, logprobs) alone or in the whole batch."""

from __future__ import annotations

import random

from batchgen import SamplingParams


def mixed_prompts(seed: int, n: int) -> list[list[int]]:
    """n prompts of 2-150 tokens; every fourth starts with the same 40 tokens."""
    rng = random.Random(seed)
    shared = [rng.randint(3, 500) for _ in range(40)]
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(2, 150))] for _ in range(n)]
    return [shared + p[:30] if i % 4 == 0 else p for i, p in enumerate(prompts)]


def mixed_params(n: int, max_tokens: int, logprobs: int | None = 0) -> list[SamplingParams]:
    """Greedy rows and sampled rows with seeds of their own (logprobs 0, off the
    defaults, so that they are compared too)."""
    kw = dict(max_tokens=max_tokens, logprobs=logprobs)
    return [
        SamplingParams(temperature=0, **kw)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, **kw)
        for i in range(n)
    ]


def row(out, logprobs: bool = True) -> tuple:
    """An output's tokens, finish reason and (with `logprobs`) the sampled tokens'
    logprobs."""
    c = out.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if logprobs else None
    return c.token_ids, c.finish_reason, lps


def probe_rows(llm, prompts, params, probes, alone: bool) -> list[tuple]:
    """The `probes` prompts' rows: each prompt in an engine call of its own, or all
    prompts in one call."""
    if alone:
        return [row(llm.generate([prompts[i]], params[i], use_tqdm=False)[0]) for i in probes]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [row(outs[i]) for i in probes]
