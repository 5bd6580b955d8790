"""The logprob-closeness rule, endings included."""

from __future__ import annotations

import pytest

from batchgen.eval.closeness import (
    close_under_top5,
    ending_mismatch,
    first_difference,
    top5_from_logprobs,
)
from batchgen.outputs import Logprob

EOS = 99


def _tops(ids):
    return lambda i: ids


def _unasked(i):
    raise AssertionError(f"no top five should be asked for (step {i})")


def _close(a, b, a_top5=_unasked, b_top5=_unasked, finish=("length", "length"), eos=()):
    return close_under_top5(
        a, b, a_top5, b_top5, a_finish=finish[0], b_finish=finish[1], eos_ids=eos
    )


def test_identical_outputs_are_close():
    assert _close([1, 2, 3], [1, 2, 3])
    assert _close([1, 2, EOS], [1, 2, EOS], finish=("stop", "stop"), eos=[EOS])
    assert _close([], [], finish=("stop", "stop"))


def test_divergence_is_close_only_when_each_token_is_in_the_other_top5():
    assert _close([1, 7, 9], [1, 8, 4], _tops([7, 8]), _tops([8, 7]))
    assert not _close([1, 7], [1, 8], _tops([7, 8]), _tops([8, 5]))
    assert not _close([1, 7], [1, 8], _tops([7, 5]), _tops([8, 7]))


def test_only_the_first_divergence_is_judged():
    asked = []

    def tops(i):
        asked.append(i)
        return [5, 6]

    assert _close([5, 6, 1], [6, 5, 2], tops, tops)
    assert asked == [0, 0]


@pytest.mark.parametrize(
    "short,finish",
    [
        ([1, 2], "length"),  # an early stop: max_tokens is 3 on the other side
        ([1, 2], "stop"),  # an early stop that claims a stop
        ([], "length"),  # an empty output
        ([], "stop"),
    ],
)
def test_an_output_cut_short_is_not_close(short, finish):
    assert first_difference(short, [1, 2, 3]) is None  # what zip() alone saw
    assert not _close(short, [1, 2, 3], finish=(finish, "length"))
    assert not _close([1, 2, 3], short, finish=("length", finish))
    assert "one stopped where the other went on" in ending_mismatch(
        short, [1, 2, 3], finish, "length"
    )


def test_a_run_past_a_missed_eos_is_not_close():
    """The longer side produced the very EOS the shorter one stopped at, then went on:
    caught by the length alone, and by eos_ids on the longer side by itself."""
    ended, ran_on = [1, EOS], [1, EOS, 4, 5]
    assert not _close(ended, ran_on, finish=("stop", "length"))
    assert not _close(ran_on, ended, finish=("length", "stop"), eos=[EOS])
    assert ending_mismatch(ended, ran_on, "stop", "length", [EOS]).startswith(
        "b ran past the EOS 99 at 1"
    )


def test_a_run_past_a_missed_stop_string_is_not_close():
    """ "w3" is a stop string: the shorter side's last token completed it, the longer
    side has the same tokens (so the same text) and went on."""
    assert not _close([1, 3], [1, 3, 4, 5], finish=("stop", "length"))
    assert not _close([1, 3, 4, 5], [1, 3], finish=("length", "stop"))


def test_a_missed_eos_after_a_near_tie_is_caught_by_eos_ids():
    """After a near-tie the rows may diverge freely, but not run past an EOS."""
    a, b = [1, 7, 5, EOS], [1, 8, EOS, 4, 6]
    tops = _tops([7, 8])
    assert _close(a, b, tops, tops, finish=("stop", "length"))  # without eos_ids
    assert not _close(a, b, tops, tops, finish=("stop", "length"), eos=[EOS])
    assert not _close(b, a, tops, tops, finish=("length", "stop"), eos=[EOS])


def test_an_eos_ending_chosen_at_a_near_tie_is_close():
    """One side chose the EOS where the other chose 6: a divergence at step 2 like any
    other, close when each is in the other side's top five there."""
    a, b, ends = [1, 4, EOS], [1, 4, 6, 9], dict(finish=("stop", "length"), eos=[EOS])
    assert _close(a, b, _tops([EOS, 6]), _tops([6, EOS]), **ends)
    assert not _close(a, b, _tops([EOS, 6]), _tops([6, 7]), **ends)  # EOS not in b's
    assert not _close(a, b, _tops([EOS, 7]), _tops([6, EOS]), **ends)  # 6 not in a's


@pytest.mark.parametrize(
    "finish",
    [("length", "stop"), ("stop", "length"), ("stop", None), ("length", "abort")],
)
def test_equal_tokens_with_different_finish_reasons_are_not_close(finish):
    """ "length" against "stop" at exactly max_tokens (the last token completed a stop
    string on one side only) is a mismatch, not a near-tie."""
    assert not _close([1, 2, 3], [1, 2, 3], finish=finish)
    assert ending_mismatch([1, 2, 3], [1, 2, 3], *finish) == (
        f"the same 3 tokens, finish reasons {finish[0]!r} and {finish[1]!r}"
    )


def test_an_eos_last_token_must_end_by_stop():
    assert not _close([1, EOS], [1, EOS], finish=("length", "length"), eos=[EOS])
    assert _close([1, EOS], [1, EOS], finish=("length", "length"))  # ignore_eos


def test_top5_from_logprob_dicts_orders_by_logprob():
    step = {t: Logprob(-float(t)) for t in (9, 3, 1, 4, 7, 2)}
    assert list(top5_from_logprobs([step])(0)) == [1, 2, 3, 4, 7]
