"""The launchers of a group's ranks 1..N-1 (rank_set.RankSet): "mp", processes that
rank 0 spawns on its own host (the default), and "ray", Ray actors placed by a placement
group over the hosts of a Ray cluster (ray_ranks.py, imported only then). Workers
(workers.py) does the rest the same way under both: the TCPStore rendezvous at
`RankSet.host`, the group, the messages, the watcher.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Collection
from multiprocessing import connection as mp_connection

import torch.multiprocessing as mp

from batchgen.config_groups import check_choice
from batchgen.distributed.rank_set import RankSet

logger = logging.getLogger(__name__)


class ProcessRanks(RankSet):
    """The ranks as processes on this host, started with the spawn method (`processes`,
    rank 1 first); a rank's status is its exit code."""

    def __init__(self, size: int, backend: str, role: str) -> None:
        super().__init__(size, backend, role)
        self.processes: list = []

    def start(self, entry: Callable[..., None], args: dict[int, tuple]) -> None:
        ctx = mp.get_context("spawn")
        for rank in self.ranks:
            process = ctx.Process(
                target=run_then_exit,
                args=(entry, *args[rank]),
                kwargs={"device": None},
                name=f"batchgen-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)

    def wait(self, ranks: Collection[int], timeout: float | None) -> dict[int, object]:
        watched = {self.processes[r - 1].sentinel: r for r in ranks}
        ready = mp_connection.wait(list(watched), timeout=timeout)
        return {watched[s]: _exit_code(self.processes[watched[s] - 1]) for s in ready}

    def describe(self, ended: dict[int, object]) -> str:
        codes = ", ".join(f"{r}: {c}" for r, c in sorted(ended.items()))
        return f"exited (rank: exit code) {codes}"

    def kill(self, rank: int) -> None:
        self.processes[rank - 1].kill()

    def stop(self, timeout_s: float) -> None:
        """Join the processes within timeout_s (one bound for all, not one each), kill
        those left, and return once every one is reaped. The watcher thread reaps them
        too (its `wait` reads exit codes): where it reaps a process first, join() sees no
        child and returns None before the code is stored, so each exit code is awaited
        here and none is still listed as a live child when the caller goes on."""
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(10)
            if _exit_code(p, 10) is None:
                logger.warning("%s (pid %s) had not ended 10 s after it was killed", p.name, p.pid)


def run_then_exit(entry: Callable[..., None], *args, **kwargs) -> None:
    """A rank's process: entry(*args, **kwargs), then, once it returned (its group left),
    an exit without the interpreter's teardown, which at 8 gloo ranks held every worker
    ~20 s after its last step (0.5 s for all 7 this way). Where entry raises,
    multiprocessing prints the traceback and the exit code is 1, as before."""
    entry(*args, **kwargs)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_ranks(launcher: str, size: int, backend: str, role: str) -> RankSet:
    """The launcher's RankSet for a group of `size` ranks (Ray imported only for "ray":
    it is an optional extra)."""
    check_choice("distributed_executor_backend", launcher)
    if launcher == "ray":
        from batchgen.distributed.ray_ranks import RayRanks

        return RayRanks(size, backend, role)
    return ProcessRanks(size, backend, role)


def _exit_code(process, timeout_s: float = 5.0) -> int | None:
    """The exit code of a process that has ended (its sentinel is ready). Another thread
    may be reaping it at the same moment (join), so it can read None for a while."""
    deadline = time.monotonic() + timeout_s
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return code
