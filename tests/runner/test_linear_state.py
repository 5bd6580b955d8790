"""The linear-attention metadata the runner builds from a step's scheduled requests."""

from __future__ import annotations

import pytest
import torch

from batchgen.runner.batch import ScheduledRequest
from batchgen.runner.linear_state import linear_metadata


def scheduled(rid: str, n: int, start: int, slot: int | None) -> ScheduledRequest:
    tokens = list(range(start + n))
    return ScheduledRequest(rid, tokens[start:], start, [0], True, state_slot=slot)


def test_rows_slots_and_fresh_requests():
    meta = linear_metadata(
        [scheduled("a", 5, 0, 3), scheduled("b", 1, 7, 0), scheduled("c", 3, 4, 2)], "cpu"
    )
    assert [(s.q_start, s.q_len, s.slot, s.has_state) for s in meta.seqs] == [
        (0, 5, 3, False),
        (5, 1, 0, True),
        (6, 3, 2, True),
    ]
    assert meta.cu_seqlens.tolist() == [0, 5, 6, 9]
    assert meta.state_slots.tolist() == [3, 0, 2]
    assert meta.fresh_slots.tolist() == [3]
    assert meta.max_q_len == 5
    assert meta.cu_seqlens.dtype == meta.state_slots.dtype == torch.int64


def test_decode_only_step():
    meta = linear_metadata([scheduled("a", 1, 9, 1), scheduled("b", 1, 3, 0)], "cpu")
    assert meta.max_q_len == 1 and meta.fresh_slots.numel() == 0


def test_request_without_slot_is_refused():
    with pytest.raises(ValueError):
        linear_metadata([scheduled("a", 2, 0, None)], "cpu")
