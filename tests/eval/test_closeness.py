"""The logprob-closeness rule."""

from __future__ import annotations

from batchgen.eval.closeness import close_under_top5, top5_from_logprobs
from batchgen.outputs import Logprob


def _tops(ids):
    return lambda i: ids


def test_identical_sequences_are_close():
    assert close_under_top5([1, 2, 3], [1, 2, 3], _tops([]), _tops([]))


def test_divergence_is_close_only_when_each_token_is_in_the_other_top5():
    assert close_under_top5([1, 7, 9], [1, 8, 4], _tops([7, 8]), _tops([8, 7]))
    assert not close_under_top5([1, 7], [1, 8], _tops([7, 8]), _tops([8, 5]))
    assert not close_under_top5([1, 7], [1, 8], _tops([7, 5]), _tops([8, 7]))


def test_only_the_first_divergence_is_judged():
    asked = []

    def tops(i):
        asked.append(i)
        return [5, 6]

    assert close_under_top5([5, 6, 1], [6, 5, 2], tops, tops)
    assert asked == [0, 0]


def test_top5_from_logprob_dicts_orders_by_logprob():
    step = {t: Logprob(-float(t)) for t in (9, 3, 1, 4, 7, 2)}
    assert list(top5_from_logprobs([step])(0)) == [1, 2, 3, 4, 7]
