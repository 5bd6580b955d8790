"""Idle and silent workers: a worker waits for rank 0's next message however long the
LLM idles (the messages' group timeout was torch's 30-minute default, after which an
idle worker's wait failed and it exited), and a worker that goes silent without ending
(SIGSTOP here; a host gone without closing its connections) fails rank 0's call within
the heartbeat bound, named, instead of leaving rank 0 waiting."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from tp_workers import answer_rank

from batchgen.distributed import tp_group
from batchgen.distributed.messages import TierMetricsQuery
from batchgen.distributed.workers import Workers

pytestmark = pytest.mark.slow


def test_a_worker_idle_past_a_short_message_timeout_exits():
    """What the message group's timeout does to a waiting worker (a test-short one)."""
    workers = Workers.spawn(answer_rank, (), 2, "gloo", message_timeout_s=2.0)
    try:
        assert workers.ask(TierMetricsQuery()) == [1]
        assert workers.ranks.wait(workers.ranks.ranks, 15.0) == {1: 1}  # its wait timed out
    finally:
        workers.shutdown(timeout_s=5)


def test_an_idle_worker_keeps_beating_and_answers_after_idling():
    """The messages' group waits a day at least (a worker idles in it: the 30-minute
    default ended it), and a worker idle past the silence bound, its heartbeat going, is
    not declared silent."""
    workers = Workers.spawn(answer_rank, (), 2, "gloo", heartbeat_s=0.5, silent_after_s=2.0)
    try:
        # torch keeps no public getter of a group's timeout; the gloo backend's options
        options = workers.tp.host_group._get_backend(torch.device("cpu")).options
        assert options._timeout >= timedelta(days=1)
        assert workers.ask(TierMetricsQuery()) == [1]
        time.sleep(5.0)  # past the silence bound, many heartbeats
        assert workers.ask(TierMetricsQuery()) == [1]
        assert not workers.exited
    finally:
        workers.shutdown(timeout_s=5)


def test_a_silent_worker_fails_the_call_within_the_bound_naming_it():
    workers = Workers.spawn(answer_rank, (), 2, "gloo", heartbeat_s=0.5, silent_after_s=3.0)
    pid = workers.processes[0].pid
    try:
        assert workers.ask(TierMetricsQuery()) == [1]
        os.kill(pid, signal.SIGSTOP)  # silent, not dead: no connection closes
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\].*no heartbeat"):
            workers.ask(TierMetricsQuery())
        assert time.monotonic() - start < 3.0 + 6.0
        workers.processes[0].join(10)
        assert not workers.processes[0].is_alive()  # killed, not left stopped
    finally:
        os.kill(pid, signal.SIGCONT) if workers.processes[0].is_alive() else None
        workers.shutdown(timeout_s=5)


def test_a_worker_silent_in_a_forward_collective_fails_it_within_the_bound():
    """Rank 0 in a tensors' collective (a forward's all-reduce) with a worker gone silent
    whose host cannot be reached (its kill closes nothing): rank 0's wait is sliced, so
    the collective fails naming the rank within the silence bound and a slice, not after
    the group's timeout (30 s here, 120 s by default)."""
    workers = Workers.spawn(
        answer_rank, (), 2, "gloo", timeout_s=30.0, heartbeat_s=0.5, silent_after_s=3.0
    )
    pid = workers.processes[0].pid
    workers.ranks.kill = lambda rank: None  # a vanished host: no connection closes
    try:
        assert workers.ask(TierMetricsQuery()) == [1]
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\].*no heartbeat"):
            tp_group().all_reduce(torch.ones(4))
        assert time.monotonic() - start < 3.0 + 6.0
        assert tp_group().waiter is not None  # the models built now wait this way
    finally:
        os.kill(pid, signal.SIGKILL)
        workers.shutdown(timeout_s=5)


def test_after_a_worker_ends_shutdown_kills_the_others_at_once():
    """Rank 1 of three is killed: rank 2, never told to stop (rank 0 does not send to a
    group short of a rank) and waiting for a message, is killed at shutdown instead of
    being waited on for the shutdown's timeout."""
    workers = Workers.spawn(answer_rank, (), 3, "gloo")
    first, second = workers.processes
    try:
        assert workers.ask(TierMetricsQuery()) == [1, 2]
        first.kill()
        deadline = time.monotonic() + 30
        while not workers.exited and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(workers.exited) == [1]
    finally:
        start = time.monotonic()
        workers.shutdown(timeout_s=30)
    assert time.monotonic() - start < 15
    assert not second.is_alive()
