"""Rank 0's messages to its tensor-parallel workers: frozen dataclasses, each type with
exactly one handler on the worker, anything else refused; the worker's loop answers
the messages that reply and stops at Shutdown."""

from __future__ import annotations

import dataclasses

import pytest

from batchgen.distributed import worker_rank, workers
from batchgen.distributed.messages import (
    PlanBegin,
    PlanQuery,
    Reconfigure,
    Shutdown,
    TierMetricsQuery,
    message_types,
)
from batchgen.engine.tensor_parallel import TPStep
from batchgen.engine.tp_worker import _Worker
from batchgen.layers.tp_group import SINGLE


def test_every_message_type_has_a_worker_handler():
    """Shutdown ends worker_rank.serve's loop; every other type reaches _Worker.handle,
    which has a method for each (the step message among them)."""
    types = message_types()
    assert TPStep in types and Shutdown in types
    assert set(_Worker.HANDLERS) == types - {Shutdown}
    for kind, name in _Worker.HANDLERS.items():
        assert callable(getattr(_Worker, name, None)), (kind, name)


def test_every_message_is_a_frozen_dataclass():
    for kind in message_types():
        assert dataclasses.is_dataclass(kind), kind
        assert kind.__dataclass_params__.frozen, kind
    with pytest.raises(dataclasses.FrozenInstanceError):
        Reconfigure(4).num_pages = 8


def test_a_message_of_an_unknown_type_raises():
    """The old setup dict, a dataclass no handler knows, and a Shutdown (serve's, never
    the worker's) are all refused by name."""
    worker = _Worker.__new__(_Worker)  # handle() dispatches on the type alone

    @dataclasses.dataclass(frozen=True)
    class Unheard:  # not a Message subclass: message_types() stays the package's own
        replies = False

    for message in ({"num_pages": 8, "host_pages": 0}, Unheard(), Shutdown(), None):
        with pytest.raises(TypeError, match=f"no handler for a {type(message).__name__}"):
            worker.handle(message)


def test_serve_answers_the_messages_that_reply_until_shutdown(monkeypatch):
    sent = [PlanBegin(), PlanQuery(), TierMetricsQuery(), Shutdown(), PlanBegin()]
    handled, gathered = [], []
    monkeypatch.setattr(worker_rank, "receive", lambda tp: sent.pop(0))
    monkeypatch.setattr(
        worker_rank.dist, "gather_object", lambda obj, out, dst, group: gathered.append(obj)
    )
    worker_rank.serve(SINGLE, lambda m: handled.append(m) or type(m).__name__)
    assert [type(m) for m in handled] == [PlanBegin, PlanQuery, TierMetricsQuery]
    assert gathered == ["PlanQuery", "TierMetricsQuery"]
    assert sent == [PlanBegin()]  # nothing read after Shutdown


def test_ask_refuses_a_message_without_a_reply():
    group = workers.Workers.__new__(workers.Workers)
    with pytest.raises(ValueError, match="PlanBegin has no reply"):
        group.ask(PlanBegin())
