"""n > 1 and best_of: one prompt fanned out into engine requests of one sample each.

The engine runs one sample per request. A prompt asking for n completions (best_of of
them sampled) becomes best_of child requests over the same prompt tokens, added one
after the other. Under prefix admission with prefix caching (the defaults) the first
child computes the prompt and the others wait for it (their first uncached page is the
one it is computing), then take its full pages from the prefix cache: the prompt's full
pages are computed once and shared; each other child recomputes only the prompt's last
page (1 to page_size tokens, the last of which gives its first token's logits).
With admission="arrival" or prefix caching off, every child computes the whole prompt.
"""

from __future__ import annotations

import dataclasses

from batchgen.outputs import CompletionOutput
from batchgen.sampling_params import SamplingParams


def num_samples(params: SamplingParams) -> int:
    """How many samples the prompt takes: best_of, or n when best_of is unset."""
    return params.best_of or params.n


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each child request: one sample each; child i of a seeded
    request has seed + i (so a seeded n=1 request and child 0 sample alike). When best_of
    exceeds n the children report their sampled token's logprob (logprobs=0 at least),
    which ranks them. Only child 0 reports prompt logprobs: the others keep their prefix
    hits."""
    count = num_samples(params)
    if count == 1 and params.n == 1 and params.best_of is None:
        return [params]
    ranked = count > params.n
    logprobs = params.logprobs
    if ranked and logprobs is None:
        logprobs = 0
    return [
        dataclasses.replace(
            params,
            n=1,
            best_of=None,
            seed=None if params.seed is None else params.seed + i,
            logprobs=logprobs,
            prompt_logprobs=params.prompt_logprobs if i == 0 else None,
        )
        for i in range(count)
    ]


def select(params: SamplingParams, samples: list[CompletionOutput]) -> list[CompletionOutput]:
    """The n completions to return, indexed 0..n-1: all of them in sampling order, or,
    when best_of > n, the n with the highest cumulative logprob, best first (stable on
    ties). Each keeps its cumulative logprob; the per-token logprobs the children reported
    only for the ranking are dropped."""
    if len(samples) > params.n:
        samples = sorted(samples, key=lambda c: -c.cumulative_logprob)[: params.n]
        if params.logprobs is None:
            samples = [dataclasses.replace(c, logprobs=None) for c in samples]
    return [dataclasses.replace(c, index=i) for i, c in enumerate(samples)]
