"""Copies between device and host pages, ordered by the copy-ordering contract.

    issuing thread                        worker thread (copy stream S)
    ---------------------------------     ---------------------------------------
    producer = Event(); producer.record(  S.wait_event(producer)        (rule 2)
        torch.cuda.current_stream())      with stream(S): copy ...
        (rule 1, default stream too)      done.record(S)
    queue.put(task) ------------------->  task.issued.set()

Consumers never read a copy's destination before `done` (rule 3): compute waits with
`handle.wait_on_current_stream()`; host-side readers call `handle.synchronize()`.
Tensors touched by the copy stay referenced by the task until the handle completes
(rule 5). On the CPU the same code runs; events are stand-ins and the copy happens on
the worker thread, so `synchronize()` waits for the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class CopyHandle:
    """A submitted copy: completion can be polled, awaited by the host, or awaited by
    a stream. `keep` holds the tensors the copy reads or writes until it completes."""

    def __init__(self, kind: str, nbytes: int, cuda: bool, keep: tuple = ()) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.keep = keep
        self.issued = threading.Event()
        self.error: BaseException | None = None
        self.done_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.cpu_seconds = 0.0
        self.submitted_at = time.perf_counter()
        self.completed_at: float | None = None
        self.on_complete: list[Callable[[], None]] = []

    def _wait_issued(self) -> None:
        self.issued.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.kind} copy failed on the copy worker") from self.error

    def is_done(self) -> bool:
        if not self.issued.is_set():
            return False
        self._wait_issued()
        return self.done_event is None or self.done_event.query()

    def copy_seconds(self) -> float:
        """Time the copy itself took on its stream (after its producer was done)."""
        if self.done_event is None:
            return self.cpu_seconds
        return self.start_event.elapsed_time(self.done_event) / 1000

    def synchronize(self) -> None:
        self._wait_issued()
        if self.done_event is not None:
            self.done_event.synchronize()

    def wait_on_current_stream(self) -> None:
        """Make the caller's current stream wait for this copy (rule 3)."""
        self._wait_issued()
        if self.done_event is not None:
            torch.cuda.current_stream().wait_event(self.done_event)


class CopyEngine:
    """Runs copy tasks on a pool of non-blocking copy streams from one worker thread.

    `ordered=False` exists only for the regression tests that prove the ordering is
    needed: it skips the producer-event wait. Nothing else may pass it.
    """

    def __init__(self, device: torch.device, num_streams: int = 2, ordered: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.ordered = ordered
        self.streams = (
            [torch.cuda.Stream(device=device) for _ in range(num_streams)] if self.cuda else []
        )
        self._next_stream = 0
        self._tasks: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="batchgen-copy", daemon=True)
        self._worker.start()

    def submit(self, kind: str, nbytes: int, copy: Callable[[], None], keep: tuple = ()):
        """Submit `copy` (which issues the actual copies) ordered after all work already
        queued on the caller's current stream. Every copy path goes through here."""
        producer = None
        if self.cuda:
            producer = torch.cuda.Event()
            producer.record(torch.cuda.current_stream(self.device))
        handle = CopyHandle(kind, nbytes, self.cuda, keep)
        self._tasks.put((handle, producer, copy))
        return handle

    @torch.inference_mode()
    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            handle, producer, copy = item
            try:
                if self.cuda:
                    stream = self.streams[self._next_stream]
                    self._next_stream = (self._next_stream + 1) % len(self.streams)
                    if self.ordered:
                        stream.wait_event(producer)
                    with torch.cuda.device(self.device), torch.cuda.stream(stream):
                        handle.start_event.record(stream)
                        copy()
                        handle.done_event.record(stream)
                else:
                    t0 = time.perf_counter()
                    copy()
                    handle.cpu_seconds = time.perf_counter() - t0
            except BaseException as e:  # surfaced to whoever waits on the handle
                handle.error = e
                logger.exception("copy task %s failed", handle.kind)
            finally:
                handle.issued.set()

    def close(self) -> None:
        self._tasks.put(None)
        self._worker.join(timeout=10)
