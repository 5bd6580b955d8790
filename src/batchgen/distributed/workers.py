"""The life of a tensor-parallel group's processes: rank 0 (the caller) starts ranks
1..N-1, they meet, rank 0 talks to them in typed messages (messages.py), and every
worker that ends before rank 0 stops them is seen at once. The launcher (launchers.py)
decides where the ranks run: processes of this host ("mp") or Ray actors over a
cluster's hosts ("ray"); the rest is the same under both.

    rank 0: Workers.spawn(target, args)         rank r: worker_rank.worker_main
      a TCPStore on a free port; start ranks      connect to the store, set "joined/r"
      1..N-1 (the launcher's RankSet)
      wait: every "joined/r", or a death  <--     (a death first: rank 0 raises, naming it)
      init_tensor_parallel(0)             <-->    init_tensor_parallel(r), same store
      watcher thread on the processes             target(tp, *args): serve(tp, handle)
      send(message), ask(message)         -->     handle each until Shutdown
      shutdown(): Shutdown, join          -->     leave the group, exit

Why rank 0 waits for the keys before it enters the rendezvous: a worker that dies
before it joins (for example a user script that builds its LLM outside
`if __name__ == "__main__":` re-runs under spawn in the worker, which then may not start
processes of its own) would otherwise leave rank 0 in torch's rendezvous until its
timeout (120 s, then a DistStoreError that names no cause). Rank 0 polls the store's
keys and the ranks' ends, and raises within a fraction of a second of the death, saying
what to do.

Under NCCL a worker that ends makes the watcher abort the tensors' group: a collective
captured in a decode graph is not one NCCL's watchdog times out, so rank 0 would
otherwise wait forever in the step it was replaying. `check()` raises after each of
rank 0's waits and before each message, so a step the abort cut short is never read.

Shutdown joins the watcher before rank 0 leaves the group, and a process that ends
without calling it (a script that drops its LLM) runs it from an atexit hook: either way
no thread of ours is inside a C++ call (the watcher's heartbeat reads) when the
interpreter tears down, which ends such a thread as it asks for the GIL back and aborts
the process with "terminate called without an active exception".
"""

from __future__ import annotations

import atexit
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from batchgen.distributed.heartbeat import HEARTBEAT_S, SILENT_AFTER_S, Pulse
from batchgen.distributed.launchers import ProcessRanks, make_ranks
from batchgen.distributed.messages import DPMessage, Message, Shutdown
from batchgen.distributed.rank_set import RankSet
from batchgen.distributed.sliced import (
    broadcast_object,
    gather_objects,
    scatter_objects,
    waited,
)
from batchgen.distributed.tensor_parallel import (
    MESSAGE_TIMEOUT_S,
    destroy_tensor_parallel,
    init_tensor_parallel,
    wait_collectives_with,
)
from batchgen.distributed.worker_rank import abort_collectives, joined_key, worker_main
from batchgen.layers.tp_group import TPGroup

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 120.0  # torch.distributed's group timeout (init_tensor_parallel)
# how long shutdown waits for the watcher (it ends once every worker is reaped)
WATCHER_JOIN_S = 10.0
# the workers' bound to end where the process exits without shutdown (Workers._at_exit):
# one told to stop ends in well under a second; one that is not listening (its rank 0
# interrupted mid-step) is killed after it, as multiprocessing would have at once
EXIT_TIMEOUT_S = 5.0

SPAWN_HINT = (
    "Workers start with the forkserver method, which (as spawn does) runs the main "
    "script again in each of them: a script that builds its LLM at top level must put that code under "
    '`if __name__ == "__main__":` (the worker\'s traceback above then says "An attempt '
    "has been made to start a new process before the current process has finished its "
    'bootstrapping phase"); otherwise its traceback says why.'
)
RAY_HINT = (
    "Under Ray every host needs batchgen and the model's files at the same paths; the "
    "rank's traceback above (its actor's log) says why it ended."
)


class WorkerStartError(RuntimeError):
    """A worker rank ended before it joined the group."""


class Workers:
    """Rank 0's handle on ranks 1..N-1: started with `spawn`, fed with `send` / `ask`,
    stopped with `shutdown`. `exited` (rank: status, an exit code under "mp") records
    each worker that ended before shutdown, as the watcher thread sees it. `role` names
    the workers in errors and logs ("tensor-parallel", "data-parallel"); `ranks` is the
    launcher's handle on them (rank_set.RankSet)."""

    def __init__(
        self,
        ranks: RankSet,
        tp: TPGroup,
        nccl: bool = False,
        role: str = "tensor-parallel",
        pulse: Pulse | None = None,
    ) -> None:
        self.ranks = ranks
        self.pulse = pulse
        self.slice_s = pulse.period_s if pulse else HEARTBEAT_S  # rank 0's waits: sliced.py
        self.role = role
        # under gloo rank 0's forwards wait for their collectives in slices too, so a
        # rank gone silent mid-forward is named within the heartbeats' bound (NCCL's
        # collectives are aborted by the watcher instead)
        self.tp = tp if nccl else wait_collectives_with(self._wait_collective)
        self.nccl = nccl
        self.exited: dict[int, int | None] = {}
        # per message type: [messages sent, their pickled bytes] (message_metrics)
        self.sent: dict[str, list[int]] = {}
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="batchgen-tp-watch", daemon=True)
        self._watcher.start()
        # a script that ends without shutting its engine down (LLM has no close, so most
        # do) stops its workers and leaves the group before the interpreter's teardown:
        # during it, a daemon thread inside a C++ call (the watcher reading heartbeats
        # from the store) that asks for the GIL back is ended by pthread_exit, whose
        # unwinding through pybind11's frames aborts the process ("terminate called
        # without an active exception"). atexit runs the hooks registered last first:
        # this one before multiprocessing's, which would SIGTERM the workers mid-wait.
        atexit.register(self._at_exit)

    @classmethod
    def spawn(
        cls,
        target: Callable[..., None],
        args: tuple,
        size: int,
        backend: str,
        timeout_s: float = RENDEZVOUS_TIMEOUT_S,
        role: str = "tensor-parallel",
        launcher: str = "mp",
        message_timeout_s: float = MESSAGE_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S,
        silent_after_s: float = SILENT_AFTER_S,
    ) -> Workers:
        """Start ranks 1..size-1 with `launcher` ("mp": processes of this host, "ray":
        Ray actors; launchers.py), each running target(tp, *args) once it joined the
        group, and join it as rank 0. WorkerStartError, within seconds, where a worker
        ends before it reached the rendezvous (SPAWN_HINT says the usual cause).
        message_timeout_s: the host messages' group's (tensor_parallel.MESSAGE_TIMEOUT_S);
        each worker bumps a heartbeat every heartbeat_s, and one silent for
        silent_after_s is killed and named (heartbeat.py)."""
        ranks = make_ranks(launcher, size, backend, role, preload=(target.__module__,))
        try:
            # port 0: the store binds a free port itself (no race with another process)
            store = dist.TCPStore(
                ranks.host,
                0,
                size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
            timeouts, beats = (timeout_s, message_timeout_s), (heartbeat_s, silent_after_s)
            where = (size, ranks.host, store.port, backend, timeouts, beats, target, args)
            ranks.start(worker_main, {rank: (rank, *where) for rank in ranks.ranks})
            _wait_joined(store, ranks, timeout_s, role)
            tp = init_tensor_parallel(
                0,
                size,
                backend,
                timeout_s=timeout_s,
                store=store,
                device=ranks.local_device,
                message_timeout_s=message_timeout_s,
            )
            reader = dist.TCPStore(ranks.host, store.port, is_master=False, timeout=store.timeout)
            pulse = Pulse(reader, ranks.ranks, heartbeat_s, silent_after_s)
        except BaseException:
            ranks.stop(0)
            raise
        return cls(ranks, tp, nccl=backend == "nccl", role=role, pulse=pulse)

    @property
    def processes(self) -> list:
        """The workers' processes, rank 1 first, under the "mp" launcher (else none)."""
        return self.ranks.processes if isinstance(self.ranks, ProcessRanks) else []

    def _watch(self) -> None:
        waiting = set(self.ranks.ranks)
        while waiting:
            try:
                ended = self.ranks.wait(waiting, self.pulse.period_s if self.pulse else None)
                if self.pulse and not self._stopping:
                    ended.update(self._silenced(waiting))
            except Exception:  # the launcher itself gone (Ray shut down): nothing to watch
                logger.debug("%s watcher stopped", self.role, exc_info=True)
                return
            for rank, status in ended.items():
                waiting.discard(rank)
                if self._stopping:
                    continue
                self.exited[rank] = status  # before the abort wakes rank 0
                logger.error("%s worker %s", self.role, self.ranks.describe({rank: status}))
                if self.nccl:  # the error to report is the exit, raised by check()
                    abort_collectives(self.tp)

    def _silenced(self, waiting: set[int]) -> dict[int, str]:
        """The ranks among `waiting` whose heartbeat stopped (heartbeat.Pulse), killed:
        a silent rank closes no connection, so rank 0 would wait on it for the messages'
        group timeout; once killed its connections close (a host that vanished closes
        none: rank 0's next message or check() still names it)."""
        silenced = {}
        for rank, quiet in self.pulse.silent().items():
            if rank in waiting:
                silenced[rank] = f"silent, no heartbeat for {quiet:.0f} s (killed)"
                self.exited[rank] = silenced[rank]  # before the kill wakes rank 0
                self.ranks.kill(rank)
        return silenced

    def _wait_collective(self, work: dist.Work) -> None:
        """Rank 0's wait for one of its tensors' collectives (TPGroup.waiter): sliced,
        check() between the slices."""
        waited(work, self.check, self.slice_s)

    @contextmanager
    def failures_named(self, grace_s: float | None = None) -> Iterator[None]:
        """An error from a collective in the block (gloo: the peer's connection reset)
        becomes check()'s, naming the rank, where a worker has ended (waiting up to
        grace_s, None: the launcher's, for the watcher to see it: a worker that raised
        may still be exiting); any other error passes unchanged, grace_s later."""
        try:
            yield
        except RuntimeError as e:
            self._raise_named(e, grace_s)
            raise

    def _raise_named(self, error: RuntimeError, grace_s: float | None = None) -> None:
        """check()'s error, raised from `error`, once the watcher has seen a worker end
        (waiting up to grace_s, None: the launcher's); returns where none has."""
        grace_s = self.ranks.grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace_s
        while not self.exited and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self.check()
        except RuntimeError as named:
            raise named from error

    def check(self) -> None:
        """RuntimeError naming the workers that ended before shutdown, if any."""
        if self.exited:
            raise RuntimeError(
                f"{self.role} worker rank(s) {sorted(self.exited)} stopped responding: "
                f"{self.ranks.describe(dict(self.exited))}; its log says why"
            )

    def send(self, message: Message | DPMessage) -> None:
        """Broadcast a message from rank 0; RuntimeError naming dead workers when one
        has ended or the broadcast fails. Pickled here, once, so its size is counted
        (`message_metrics`)."""
        if not isinstance(message, Shutdown):
            self.check()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        counts = self.sent.setdefault(type(message).__name__, [0, 0])
        counts[0] += 1
        counts[1] += len(payload)
        try:
            broadcast_object(payload, self.tp.host_group, self.check, self.slice_s)
        except RuntimeError as e:
            # the watcher's account first (a silent rank it killed, or a killed one
            # whose exit it has yet to see: the peer's reset can come before that)
            self._raise_named(e)
            dead = sorted(self.ranks.wait(self.ranks.ranks, 0))
            raise RuntimeError(
                f"{self.role} worker rank(s) {dead or '?'} stopped responding: {e}"
            ) from e

    def message_metrics(self, kind: type) -> dict:
        """What rank 0 has sent in messages of type `kind` (an engine's step message),
        every worker receiving the same bytes: `step_messages`, `step_message_bytes_total`
        (pickled) and `step_message_bytes` (their mean size)."""
        count, size = self.sent.get(kind.__name__, (0, 0))
        return {
            "step_messages": count,
            "step_message_bytes_total": size,
            "step_message_bytes": size / count if count else 0.0,
        }

    def scatter(self, items: list, kind: type) -> None:
        """items[r - 1] to worker r alone (each takes it with `receive_scattered`), its
        bytes counted with the messages of type `kind` it goes with."""
        self.check()
        payloads = [b""] + [pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL) for item in items]
        counts = self.sent.setdefault(kind.__name__, [0, 0])
        counts[1] += sum(len(p) for p in payloads)
        scatter_objects(payloads, self.tp.host_group, self.check, self.slice_s)

    def gather(self) -> list:
        """What each worker answered the last message with, rank 1 first."""
        replies = gather_objects(self.tp.host_group, self.tp.size, self.check, self.slice_s)
        return replies[1:]

    def ask(self, message: Message | DPMessage) -> list:
        """Send a message that `replies`; each worker's answer, rank 1 first."""
        if not message.replies:
            raise ValueError(f"{type(message).__name__} has no reply to wait for")
        self.send(message)
        with self.failures_named():  # a worker killed mid-answer named, not the reset
            return self.gather()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they leave the group) and leave it too. Told to stop, they
        get timeout_s to end; where a worker has ended first none is told (the others
        may be waiting on it inside a collective, or on a message that never comes), so
        the rest are killed at once instead of waited on."""
        self._stopping = True
        atexit.unregister(self._at_exit)
        told = False
        try:
            if not self.exited and not self.ranks.wait(self.ranks.ranks, 0):
                try:
                    self.send(Shutdown())
                    told = True
                except RuntimeError as e:  # whatever stopped them is the error to report
                    logger.warning("%s shutdown: %s", self.role, e)
        finally:
            try:
                self.ranks.stop(timeout_s if told else 0.0)
                self._join_watcher()  # before the group (and its store) goes
            finally:
                destroy_tensor_parallel()

    def _at_exit(self) -> None:
        """The process ends and these workers were never shut down: shut them down now,
        while the interpreter is whole (__init__ says why)."""
        self.shutdown(EXIT_TIMEOUT_S)

    def _join_watcher(self) -> None:
        """Wait for the watcher, which ends once it saw every worker end: no thread of
        these workers' is left in a store call when the caller goes on (the process may
        be ending: see the atexit hook in __init__)."""
        self._watcher.join(WATCHER_JOIN_S)
        if self._watcher.is_alive():
            logger.warning(
                "%s watcher still running %.0f s after shutdown", self.role, WATCHER_JOIN_S
            )


def _wait_joined(
    store: dist.TCPStore, ranks: RankSet, timeout_s: float, role: str = "tensor-parallel"
) -> None:
    """Return once every worker set its key in the store; WorkerStartError naming those
    that ended first, TimeoutError after timeout_s."""
    keys = [joined_key(rank) for rank in ranks.ranks]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        # wakes as soon as a worker ends, else every 50 ms to look at the keys again
        dead = ranks.wait(ranks.ranks, 0.05)
        if dead:
            hint = SPAWN_HINT if isinstance(ranks, ProcessRanks) else RAY_HINT
            raise WorkerStartError(
                f"{role} worker rank(s) {sorted(dead)} exited while starting, before "
                f"joining the group: {ranks.describe(dead)}. " + hint
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role} workers did not join the group within {timeout_s:.0f} s")
