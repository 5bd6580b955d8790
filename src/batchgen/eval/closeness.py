"""The logprob-closeness rule used to judge reduced-precision runs.

Two greedy sequences are close when they are identical, or when at the first position
where they differ each side's token is among the other side's five most likely tokens
(a near-tie that rounding may flip); after that they may diverge freely. A row that
breaks the rule has collapsed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TopIds = Callable[[int], Sequence[int]]


def close_under_top5(
    a_tokens: Sequence[int], b_tokens: Sequence[int], a_top5: TopIds, b_top5: TopIds
) -> bool:
    """a_top5(i) / b_top5(i): each side's five most likely token ids at step i (asked for
    only at the first divergence)."""
    for i, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a != b:
            return a in b_top5(i) and b in a_top5(i)
    return True


def top5_from_logprobs(logprobs: Sequence[dict]) -> TopIds:
    """Top-5 ids from batchgen's per-step {token id: Logprob} dicts (logprobs >= 5)."""
    return lambda i: sorted(logprobs[i], key=lambda t: -logprobs[i][t].logprob)[:5]
