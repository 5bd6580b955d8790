"""Heartbeats: how rank 0 finds a worker rank that went silent without ending (its host
gone without closing its connections, a process stopped), which no connection reset
reports and the host messages' group (a year's timeout: tensor_parallel.py) would wait
on for good.

    worker rank r: start_beating(...)             rank 0: Pulse(store, ranks, ...)
      a thread adds 1 to "batchgen/beat/r" in       silent(): the ranks whose counter
      rank 0's store every `period_s`                has not moved for `silent_after_s`
                                                     (Workers' watcher kills them and
                                                     names them in the call's error)

Counters, not clocks: rank 0 times a rank's silence on its own monotonic clock, so the
hosts' clocks need not agree; where rank 0 itself did not look for a while (its process
stopped), every rank gets a fresh bound. A worker whose rank 0 is gone needs no beat of
rank 0's: under "mp" its wait fails as rank 0's connections close, under Ray the actors
of a driver that ended are ended with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # how often each worker bumps its counter
SILENT_AFTER_S = 30.0  # a worker whose counter stood still this long is declared silent


def beat_key(rank: int) -> str:
    return f"batchgen/beat/{rank}"


def start_beating(
    host: str, port: int, rank: int, period_s: float, silent_after_s: float
) -> Callable[[float], None]:
    """A daemon thread that bumps this rank's counter in rank 0's store (host:port, its
    own connection) every period_s until the function returned is called (a store that
    does not answer, rank 0 stopped or ending, is logged once and tried again).
    stop(timeout_s): no beat after the one in flight, the thread joined within timeout_s.
    A worker stops it before it ends: a daemon thread left inside the store's call when
    the interpreter tears down is ended as it asks for the GIL back, and that ending
    (pthread_exit, unwound through C++ frames that may not throw) aborts the process:
    "terminate called without an active exception"."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=silent_after_s))
    key = beat_key(rank)
    stopped = threading.Event()

    def beat() -> None:
        failing = False
        while not stopped.is_set():
            try:
                store.add(key, 1)
                failing = False
            except Exception:
                if not failing:
                    logger.warning("rank %d: rank 0's store did not take a heartbeat", rank)
                failing = True
            stopped.wait(period_s)

    thread = threading.Thread(target=beat, name="batchgen-heartbeat", daemon=True)
    thread.start()

    def stop(timeout_s: float) -> None:
        stopped.set()
        thread.join(timeout_s)

    return stop


class Pulse:
    """Rank 0's reading of the workers' counters in `store` (a client of its own)."""

    def __init__(
        self, store: dist.Store, ranks: Collection[int], period_s: float, silent_after_s: float
    ) -> None:
        self.store, self.period_s, self.silent_after_s = store, period_s, silent_after_s
        now = time.monotonic()
        self.seen = {rank: (-1, now) for rank in ranks}  # rank: (counter, when it moved)
        self.looked = now

    def silent(self) -> dict[int, float]:
        """The ranks whose counter has not moved for silent_after_s: how long, rank 0's
        clock."""
        now, quiet = time.monotonic(), {}
        if now - self.looked > self.silent_after_s / 2:  # rank 0 was not running
            self.seen = {rank: (count, now) for rank, (count, _) in self.seen.items()}
        self.looked = now
        for rank, (count, since) in self.seen.items():
            now_count = self.store.add(beat_key(rank), 0)
            if now_count != count:
                self.seen[rank] = (now_count, now)
            elif now - since > self.silent_after_s:
                quiet[rank] = now - since
        return quiet
