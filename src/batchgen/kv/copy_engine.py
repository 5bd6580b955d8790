"""Copies between device and host pages, ordered by the copy-ordering rules
(kv/copy_rules.py: the numbers below are that table's).

    issuing thread                        worker thread (copy stream S)
                                          (issue="inline", CUDA: the issuing thread)
    ---------------------------------     ---------------------------------------
    producer = Event(); producer.record(  S.wait_event(producer)        (rule 2)
        torch.cuda.current_stream())      with stream(S): copy(handle)
        (rule 1, default stream too)        gate events: handle.mark(layer)
    queue.put(task) ------------------->  done.record(S); task.issued.set()

Consumers never read a copy's destination before it is written (rule 3): compute waits
with `handle.wait_layer(layer)` (a load's pages of one layer, or a store's source pages
read) or `handle.wait_on_current_stream()` (all of it); host-side readers call
`handle.synchronize()`. A body may leave the last part of its work to the submitting
stream (`handle.defer`: a load's scatter of staged pages into the pool, so that no kernel
runs on a copy stream): the first wait that needs that part queues it there, on the
submitting stream after the copy stream's transfer (`run_finishers`), and the tier's
poll queues any a failed step left; the copy is done once they have run. Tensors touched
by the copy stay referenced by the handle until it completes (rule 5). No task issues
CUDA work inside `paused()` (rule 6).

On the CPU the same code runs with one worker thread per copy stream, so copies on
different streams run concurrently as they would on a GPU and a missing wait between
them shows up on the CPU too; a "stream wait" there is the waiting thread blocking until
the event is set. CPU compute is synchronous, so a producer is always done at call time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.profiler import record_function

from batchgen.config_groups import check_choice

logger = logging.getLogger(__name__)


class _Gate:
    """A point inside a copy that consumers may wait for: a CUDA event on a GPU, a
    threading.Event on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event() if cuda else threading.Event()

    def mark(self) -> None:
        if isinstance(self.event, threading.Event):
            self.event.set()
        else:
            self.event.record()  # on the copy stream: the worker made it current

    def wait_on_current_stream(self) -> None:
        if isinstance(self.event, threading.Event):
            self.event.wait()
        else:
            torch.cuda.current_stream().wait_event(self.event)


class CopyHandle:
    """A submitted copy: completion can be polled, awaited by the host, or awaited by
    a stream, whole or gate by gate. `keep` holds the tensors the copy reads or writes
    until it completes. `num_gates` gates are points inside the copy (a load has one a
    layer, reached once that layer's pages are written, and marks them a group of layers
    at a time; a store marks one once its source pages are read)."""

    def __init__(self, kind: str, nbytes: int, cuda: bool, num_gates: int = 0) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.keep: tuple = ()
        self.issued = threading.Event()
        self.completed = threading.Event()  # CPU: the copy ran
        self.error: BaseException | None = None
        self.cuda = cuda
        self.done_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.gates = [_Gate(cuda) for _ in range(num_gates)]
        self._marked = 0  # gates before it are marked
        self.cpu_seconds = 0.0
        # CUDA, issued inline: the stream the copy was submitted from (its producer's),
        # where deferred parts run; the finishers, (last gate, function) in order, and
        # how many have run
        self.consumer: torch.cuda.Stream | None = None
        self._finishers: list[tuple[int, Callable[[], None]]] = []
        self._finished = 0
        self._finish_lock = threading.Lock()
        self.finished_event = torch.cuda.Event() if cuda else None

    def release(self) -> None:
        """Drop the tensors the copy kept alive (rule 5): its completion was awaited."""
        self.keep = ()

    def _wait_issued(self) -> None:
        self.issued.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.kind} copy failed on the copy worker") from self.error

    def mark(self, gate: int) -> None:
        """Called by the copy body, on its stream, when gate `gate` is reached: so are the
        gates before it not marked yet, which share its point from then on (one event for
        a group of layers). Nobody reads the gates before the body has run (`issued`)."""
        self.gates[gate].mark()
        for g in range(self._marked, gate):
            self.gates[g] = self.gates[gate]
        self._marked = max(self._marked, gate + 1)

    def defer(self, gate: int, finish: Callable[[], None]) -> None:
        """Called by the copy body: `finish()` does the copy's work up to gate `gate` (and
        marks it) on the submitting stream, `consumer`, after what the body issued; it
        runs when a wait first needs it (run_finishers), in the order deferred."""
        self._finishers.append((gate, finish))

    def run_finishers(self, gate: int | None = None) -> None:
        """Run, in order, the deferred parts needed for gate `gate` (all with None), each
        once; after the last, the copy's finished event on the consumer stream."""
        self._wait_issued()
        with self._finish_lock:
            todo = self._finishers
            while self._finished < len(todo) and (
                gate is None or self._finished == 0 or todo[self._finished - 1][0] < gate
            ):
                todo[self._finished][1]()
                self._finished += 1
                if self._finished == len(todo) and self.cuda:
                    self.finished_event.record(self.consumer)

    @property
    def has_deferred(self) -> bool:
        """Deferred parts not run yet (the copy is not done before they are)."""
        return self._finished < len(self._finishers)

    def is_done(self) -> bool:
        if not self.issued.is_set():
            return False
        self._wait_issued()
        if self.has_deferred:
            return False
        if not self.cuda:
            return self.completed.is_set()
        return self.done_event.query() and (not self._finishers or self.finished_event.query())

    def copy_seconds(self) -> float:
        """Time the copy itself took on its stream (after its producer was done)."""
        if self.done_event is None:
            return self.cpu_seconds
        return self.start_event.elapsed_time(self.done_event) / 1000

    def synchronize(self) -> None:
        self.run_finishers()
        if self.cuda:
            self.done_event.synchronize()
            if self._finishers:
                self.finished_event.synchronize()
        else:
            self.completed.wait()

    def wait_on_current_stream(self) -> None:
        """Make the caller's current stream wait for the whole copy (rule 3)."""
        self.run_finishers()
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.done_event)
            if self._finishers:
                torch.cuda.current_stream().wait_event(self.finished_event)
        else:
            self.completed.wait()

    def wait_gates(self) -> None:
        """Wait (on the current stream) for every gate: a load's pages all written, a
        store's source read; the whole copy without gates."""
        self.wait_layer(len(self.gates) - 1)

    def wait_layer(self, layer: int) -> None:
        """Make the caller's current stream wait until what layer `layer` of the forward
        touches is safe: that layer's loaded pages are written (one gate per layer), or
        the store's source pages are read (one gate); the whole copy without gates."""
        self._wait_issued()
        if not self.gates:
            self.wait_on_current_stream()
        else:
            gate = min(layer, len(self.gates) - 1)
            self.run_finishers(gate)
            self.gates[gate].wait_on_current_stream()


class CopyEngine:
    """Runs copy tasks on a pool of non-blocking copy streams, each ordered after its
    producer (rules 1-2 of kv/copy_rules.py)."""

    def __init__(
        self,
        device: torch.device,
        num_streams: int = 2,
        issue: str = "worker",
        background: bool = False,
    ):
        check_choice("tier_copy_issue", issue)
        self.device = device
        self.cuda = device.type == "cuda"
        # "inline" (CUDA only): the submitting thread issues the copy itself, at once. A
        # CUDA copy is asynchronous either way; inline spares the worker's GIL hand-offs
        # (the main thread waits for the GIL after each GPU sync while the worker runs),
        # "worker" lets the issuing overlap the main thread's GIL-free waits.
        self.inline = issue == "inline" and self.cuda
        # background=True: one more stream (a CPU worker) reserved for background
        # copies, so their long transfers never queue ahead of a copy a step waits on
        self._lanes = num_streams
        self.background = background
        lanes = num_streams + (1 if background else 0)
        self.streams = [torch.cuda.Stream(device=device) for _ in range(lanes)] if self.cuda else []
        self._next = 0
        self._cond = threading.Condition()
        self._paused = False
        self._issuing = 0
        # one worker issues to every CUDA stream; on the CPU one worker per stream
        self._queues = [queue.Queue() for _ in range(1 if self.cuda else lanes)]
        self._workers = [
            threading.Thread(target=self._run, args=(q,), name="batchgen-copy", daemon=True)
            for q in self._queues
        ]
        for w in self._workers:
            w.start()

    def submit(
        self,
        kind: str,
        nbytes: int,
        copy: Callable[[CopyHandle], object],
        num_gates: int = 0,
        background: bool = False,
    ) -> CopyHandle:
        """Submit `copy(handle)` (which issues the actual copies and returns what they
        must keep alive) ordered after all work already queued on the caller's current
        stream. Every copy path goes through here. `background`: on the reserved
        stream if the engine has one (no step is expected to wait on it soon)."""
        producer = None
        if self.cuda:
            producer = torch.cuda.Event()
            producer.record(torch.cuda.current_stream(self.device))
        handle = CopyHandle(kind, nbytes, self.cuda, num_gates)
        if background and self.background:
            lane = self._lanes
        else:
            lane, self._next = self._next % self._lanes, self._next + 1
        q = self._queues[lane % len(self._queues)]
        stream = self.streams[lane] if self.cuda else None
        if self.inline and not self._paused and not torch.cuda.is_current_stream_capturing():
            # on this thread (never paused here: it is the one that captures)
            self._issue((handle, producer, copy, stream), inline=True)
        else:
            q.put((handle, producer, copy, stream))
        return handle

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No copy task issues CUDA work while the block runs (copies already issued
        keep running on their streams; queued ones wait)."""
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._paused = True
            while self._issuing:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def _run(self, tasks: queue.Queue) -> None:
        while True:
            item = tasks.get()
            if item is None:
                return
            self._issue(item)
            del item  # the worker keeps no reference to a task once it is issued

    @torch.inference_mode()
    def _issue(self, task: tuple, inline: bool = False) -> None:
        """Issue one task, on the worker or (issue="inline") on the asking thread: not
        while paused (rule 6); its stream waits for the producer (rule 2), then the copy
        body runs on that stream between the start and done events. Issued inline, the
        handle's `consumer` is the asking thread's stream, the producer's (what a body
        defers runs there); by the worker it has none."""
        handle, producer, copy, stream = task
        if inline:
            handle.consumer = torch.cuda.current_stream(device=self.device)
        with self._cond:
            while self._paused:  # a graph capture is under way
                self._cond.wait()
            self._issuing += 1
        try:
            if self.cuda:
                stream.wait_event(producer)  # rule 2
                with (
                    torch.cuda.device(self.device),
                    torch.cuda.stream(stream),
                    record_function("batchgen.copy"),
                ):
                    handle.start_event.record(stream)
                    handle.keep = (copy(handle),)
                    handle.done_event.record(stream)
            else:
                t0 = time.perf_counter()
                handle.keep = (copy(handle),)
                handle.cpu_seconds = time.perf_counter() - t0
        except BaseException as e:  # surfaced to whoever waits on the handle
            handle.error = e
            logger.exception("copy task %s failed", handle.kind)
            for gate in handle.gates:  # nobody may wait forever on a failed copy
                if not self.cuda:
                    gate.mark()
        finally:
            handle.completed.set()
            handle.issued.set()
            with self._cond:
                self._issuing -= 1
                self._cond.notify_all()
            del task, handle, producer, copy, stream

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for w in self._workers:
            w.join(timeout=10)
