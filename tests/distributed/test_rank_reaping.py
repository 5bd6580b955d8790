"""ProcessRanks.stop returns only once every worker process is reaped. The watcher
thread reads exit codes too, so it can reap a process at the moment stop() joins it: the
join then finds no child and returns before the code is stored, and a caller that goes
on (a job that returns, a test listing live children) saw the worker as still running."""

from __future__ import annotations

import threading
import time

from batchgen.distributed.launchers import ProcessRanks, RankProcess, forkserver, run_then_exit


class _ReapedElsewhere:
    """A process another thread reaps: join() returns at once with nothing reaped, as
    popen's join does after losing the race; its exit code appears `delay_s` later."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name, self.pid = name, 0
        self._code: int | None = None
        self.killed = False
        threading.Timer(delay_s, self._reaped).start()

    def _reaped(self) -> None:
        self._code = 0

    def join(self, timeout: float | None = None) -> None:
        return None

    def is_alive(self) -> bool:
        return self._code is None  # popen's poll reads "no code yet" as alive

    def kill(self) -> None:
        self.killed = True

    @property
    def exitcode(self) -> int | None:
        return self._code


def test_stop_waits_for_every_exit_code_another_thread_is_reaping():
    ranks = ProcessRanks(3, "gloo", "tensor-parallel")
    ranks.processes = [_ReapedElsewhere(f"rank{r}", 0.2 * r) for r in (1, 2)]
    started = time.monotonic()
    ranks.stop(0.0)
    assert [p.exitcode for p in ranks.processes] == [0, 0]
    assert time.monotonic() - started < 5.0


def _marks_its_teardown(path: str) -> None:
    """Leave a file, and another from an atexit handler (the interpreter's teardown)."""
    import atexit
    from pathlib import Path

    Path(path, "ran").touch()
    atexit.register(Path(path, "teardown").touch)


def _raises(path: str) -> None:
    raise RuntimeError("this rank fails")


def test_a_rank_process_ends_without_the_interpreters_teardown(tmp_path):
    """ProcessRanks' processes (forks of the forkserver) leave once their entry
    returned, exit code 0, without the teardown that held each of 8 gloo ranks ~20 s;
    one whose entry raises still exits 1 with its traceback."""
    ctx = forkserver()
    done = ctx.Process(target=run_then_exit, args=(_marks_its_teardown, str(tmp_path)))
    done.start()
    done.join(120)
    assert done.exitcode == 0
    assert (tmp_path / "ran").exists() and not (tmp_path / "teardown").exists()
    failed = ctx.Process(target=run_then_exit, args=(_raises, str(tmp_path)))
    failed.start()
    failed.join(120)
    assert failed.exitcode == 1


def _sleeps() -> None:
    time.sleep(0.1)


def _read_exit_code(process, seen: list) -> None:
    while (code := process.exitcode) is None:
        pass  # polls back to back, as fast as the watcher's and stop's reads can meet
    seen.append(code)


def test_threads_reading_a_rank_process_exit_code_at_once_all_read_it():
    """A forkserver process's exit code comes once, through a pipe: threads polling it
    at the same moment (the watcher and stop) must each read the code, not the pipe's
    end (multiprocessing's own forkserver process stores 255 for the one that does)."""
    forkserver()
    for _ in range(3):
        process = RankProcess(target=_sleeps, daemon=True)
        process.start()
        seen = []
        readers = [threading.Thread(target=_read_exit_code, args=(process, seen)) for _ in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(60)
        assert seen == [0, 0, 0, 0]
