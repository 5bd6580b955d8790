"""The logprob-closeness rule used to judge reduced-precision runs.

Two greedy outputs of the same request, run with the same stop conditions, are close
when they are identical (the same tokens, so the same length, and the same finish
reason), or when at the first position where their tokens differ each side's token is
among the other side's five most likely tokens (a near-tie that rounding may flip);
after that they may diverge freely, endings included. A pair that breaks the rule has
collapsed.

Endings are judged as tokens. batchgen, like transformers' generate(), keeps the token
that ended an output in its token ids: an EOS, a stop token id, the token that completed
a stop string. An ending chosen at a near-tie is therefore a token divergence like any
other, judged at that step: the EOS on one side and another token on the other, each
among the other side's top five.

    a: t0 t1 t2 EOS            a stopped at step 3 ...
    b: t0 t1 t2 t3  t4 t5      ... where b chose t3: close when EOS is in b's top five
                               at step 3 and t3 in a's

What is left once no token differs is never a near-tie:

- one output is a proper prefix of the other (a length difference is a divergence at
  position min(len)): one side stopped where the other, after the very same tokens,
  went on. With the same stop conditions on both sides that is an early stop, or a
  missed EOS, stop token or stop string on the longer side. (A shorter side that ended
  on a stop string the other side was not asked for is outside the rule: both sides
  must run with the same stops.)
- the same tokens under different finish reasons: "length" on one side and "stop" on
  the other, even at exactly max_tokens, is a mismatch.

`eos_ids` (the token ids that end a row on both sides: the EOS ids unless ignore_eos,
plus the request's stop_token_ids; leave it empty under ignore_eos) adds a check of
each side on its own, so that a row running past an EOS after an earlier near-tie is
caught too: an EOS before a side's last token, or a last token that is an EOS under a
finish reason other than "stop", breaks the pair.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

TopIds = Callable[[int], Sequence[int]]


def first_difference(a_tokens: Sequence[int], b_tokens: Sequence[int]) -> int | None:
    """The first position below both lengths where the tokens differ; None when one
    output is a prefix of the other (or they are equal)."""
    return next((i for i, (a, b) in enumerate(zip(a_tokens, b_tokens)) if a != b), None)


def _ran_past(tokens: Sequence[int], finish: str | None, eos_ids: Collection[int]) -> str | None:
    past = next((i for i, t in enumerate(tokens[:-1]) if t in eos_ids), None)
    if past is not None:
        return f"ran past the EOS {tokens[past]} at {past} (length {len(tokens)})"
    if tokens and tokens[-1] in eos_ids and finish != "stop":
        return f"ends on the EOS {tokens[-1]} with finish reason {finish!r}"
    return None


def ending_mismatch(
    a_tokens: Sequence[int],
    b_tokens: Sequence[int],
    a_finish: str | None,
    b_finish: str | None,
    eos_ids: Collection[int] = (),
) -> str | None:
    """Why the two outputs' endings alone make them not close, whatever the top fives
    (see the module docstring); None when they don't (identical, or a token divergence
    comes first and decides)."""
    for side, tokens, finish in (("a", a_tokens, a_finish), ("b", b_tokens, b_finish)):
        why = _ran_past(tokens, finish, eos_ids)
        if why is not None:
            return f"{side} {why}"
    if first_difference(a_tokens, b_tokens) is not None:
        return None
    if len(a_tokens) != len(b_tokens):
        return (
            f"one stopped where the other went on: lengths {len(a_tokens)} and "
            f"{len(b_tokens)}, finish reasons {a_finish!r} and {b_finish!r}"
        )
    if a_finish != b_finish:
        return f"the same {len(a_tokens)} tokens, finish reasons {a_finish!r} and {b_finish!r}"
    return None


def close_under_top5(
    a_tokens: Sequence[int],
    b_tokens: Sequence[int],
    a_top5: TopIds,
    b_top5: TopIds,
    *,
    a_finish: str | None,
    b_finish: str | None,
    eos_ids: Collection[int] = (),
) -> bool:
    """The rule. a_top5(i) / b_top5(i): each side's five most likely token ids at step i
    (asked for only at the first token divergence); a_finish / b_finish: each side's
    finish reason ("stop", "length"); eos_ids: see the module docstring."""
    if ending_mismatch(a_tokens, b_tokens, a_finish, b_finish, eos_ids) is not None:
        return False
    d = first_difference(a_tokens, b_tokens)
    return d is None or (a_tokens[d] in b_top5(d) and b_tokens[d] in a_top5(d))


def top5_from_logprobs(logprobs: Sequence[dict]) -> TopIds:
    """Top-5 ids from batchgen's per-step {token id: Logprob} dicts (logprobs >= 5)."""
    return lambda i: sorted(logprobs[i], key=lambda t: -logprobs[i][t].logprob)[:5]
