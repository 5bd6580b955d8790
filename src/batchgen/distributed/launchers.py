"""The launchers of a group's ranks 1..N-1 (rank_set.RankSet): "mp", processes that
rank 0 spawns on its own host (the default), and "ray", Ray actors placed by a placement
group over the hosts of a Ray cluster (ray_ranks.py, imported only then). Workers
(workers.py) does the rest the same way under both: the TCPStore rendezvous at
`RankSet.host`, the group, the messages, the watcher.

"mp" starts its processes with the forkserver method: a server process, started once
per parent from a fresh interpreter (as spawn starts a rank), imports torch and the
ranks' modules once, and each rank is a fork of it. A spawned rank imported them
itself, 2-4 s of CPU each, and 7 ranks on 2 cores took 9-11 s before any of them was of
use; forked, the same 7 start in under 0.1 s once the server runs. What stays as under
spawn: a rank still runs the parent's main script again (multiprocessing prepares it
the same way: SPAWN_HINT), and it runs with the parent's environment, stdout and stderr
as they are when the rank starts (run_then_exit puts them in place: the server's own
are those it started with).
CUDA: the server is a new interpreter, never a fork of the parent, so a parent that
initialised CUDA hands none of it on, and the server only imports modules, none of
which touches CUDA at import (tests/distributed/test_forkserver.py), so each rank
initialises CUDA itself after its fork, as a spawned one did.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from multiprocessing import connection as mp_connection
from multiprocessing import popen_forkserver, reduction
from multiprocessing.context import BaseContext, ForkServerProcess

import torch.multiprocessing as mp

from batchgen.config_groups import check_choice
from batchgen.distributed.rank_set import RankSet

logger = logging.getLogger(__name__)

# what every rank imports before it is of use: torch (2-3 s of CPU), and transformers
# as a rank's model build imports it (ModelSource.load_config's AutoConfig; the models
# package and what any model's config module imports, here through llama's: 1.5 s)
PRELOAD = (
    "torch",
    "torch.distributed",
    "batchgen.distributed.worker_rank",
    "transformers",
    "transformers.models.auto.configuration_auto",
    "transformers.models.llama.configuration_llama",
)


def forkserver(preload: Iterable[str] = ()) -> BaseContext:
    """The forkserver start method's context, its server (one a parent, started by the
    first process it starts) importing PRELOAD and `preload` (module names) before it
    forks any. Where the server already runs, it keeps what it imported: a later
    caller's modules are imported by each of its processes, as under spawn. Never
    "__main__": the server would run the main script, an unguarded one's LLM too."""
    ctx = mp.get_context("forkserver")
    modules = [m for m in dict.fromkeys([*PRELOAD, *preload]) if m != "__main__"]
    ctx.set_forkserver_preload(modules)
    return ctx


class _Popen(popen_forkserver.Popen):
    """The forkserver's Popen, its exit code read by one thread at a time: the server
    writes a process's code once, to a pipe, and a second thread reading at the same
    moment (the watcher's `wait` beside `stop`'s join) found the pipe's end instead
    and stored 255 as the code (a waitpid-based poll, fork's or spawn's, returned None,
    which is not stored)."""

    def __init__(self, process_obj) -> None:
        self._reading = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        with self._reading:
            return super().poll(flag)


class RankProcess(ForkServerProcess):
    """A process of the forkserver whose exit code threads may read at once (_Popen)."""

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class ProcessRanks(RankSet):
    """The ranks as processes on this host, forks of the forkserver (`processes`, rank 1
    first); a rank's status is its exit code. `preload`: the modules the server imports
    besides PRELOAD (the ranks' target's)."""

    def __init__(self, size: int, backend: str, role: str, preload: Iterable[str] = ()) -> None:
        super().__init__(size, backend, role)
        self.preload = tuple(preload)
        self.processes: list = []

    def start(self, entry: Callable[..., None], args: dict[int, tuple]) -> None:
        forkserver((entry.__module__, *self.preload))
        environ = dict(os.environ)
        for rank in self.ranks:
            process = RankProcess(
                target=run_then_exit,
                args=(entry, *args[rank]),
                kwargs={"device": None, "environ": environ, "stdio": ParentStdio()},
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
        those left, and return once every one is reaped. The watcher thread reads exit
        codes too (its `wait`): where it reads a process's first, join() can return
        before the code is stored here, so each exit code is awaited and none is still
        listed as a live child when the caller goes on."""
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


class ParentStdio:
    """The parent's stdout and stderr (fds 1 and 2) where it starts a process: pickled
    (Process.start) as the start method's handles of them, unpickled in the process as
    its own copies of those fds, or None for one the parent has closed."""

    def __reduce__(self):
        return (_inherited_fds, tuple(_handed_fd(fd) for fd in (1, 2)))


def _handed_fd(fd: int):
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _inherited_fds(*handles) -> list[int | None]:
    return [None if h is None else h.detach() for h in handles]


def run_then_exit(
    entry: Callable[..., None],
    *args,
    environ: dict[str, str] | None = None,
    stdio: list[int | None] | None = None,
    **kwargs,
) -> None:
    """A rank's process: its environment made `environ` and its stdout and stderr the
    fds `stdio` (ParentStdio) where given, the parent's when it started the rank (a fork
    of the forkserver has the server's); entry(*args, **kwargs), then, once it returned
    (its group left), an exit without the interpreter's teardown, which at 8 gloo ranks
    held every worker ~20 s after its last step (0.5 s for all 7 this way). Where entry
    raises, multiprocessing prints the traceback and the exit code is 1, as before."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if stdio:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for target, fd in zip((1, 2), stdio):
            if fd is not None:
                os.dup2(fd, target)
                os.close(fd)
    entry(*args, **kwargs)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_ranks(
    launcher: str, size: int, backend: str, role: str, preload: Iterable[str] = ()
) -> RankSet:
    """The launcher's RankSet for a group of `size` ranks (Ray imported only for "ray":
    it is an optional extra; `preload`, the modules a rank runs, is for "mp")."""
    check_choice("distributed_executor_backend", launcher)
    if launcher == "ray":
        from batchgen.distributed.ray_ranks import RayRanks

        return RayRanks(size, backend, role)
    return ProcessRanks(size, backend, role, preload)


def _exit_code(process, timeout_s: float = 5.0) -> int | None:
    """The exit code of a process that has ended (its sentinel is ready). Another thread
    may be reaping it at the same moment (join), so it can read None for a while."""
    deadline = time.monotonic() + timeout_s
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return code
