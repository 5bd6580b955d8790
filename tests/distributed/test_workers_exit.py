"""A tensor-parallel rank 0 ends with none of its threads inside a C++ call, whether its
engine was shut down or the script simply ended: otherwise the interpreter's teardown
ends such a daemon thread (the watcher reading heartbeats from the store) as it asks for
the GIL back, and the process aborts with "terminate called without an active
exception" (SIGABRT) after its work is done, as benchmarks/tp_scaling.py's TP=2 run did
once in CI."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import save_tiny_model
from tp_workers import answer_rank

from batchgen.distributed.heartbeat import beat_key, start_beating
from batchgen.distributed.messages import TierMetricsQuery
from batchgen.distributed.workers import Workers

# a user's script: an LLM at tensor_parallel_size=2, a generate, and the end of the
# script, no shutdown. report() is registered before the LLM, so it runs after the
# engine's own exit hook (atexit runs the hook registered last first): what it prints is
# what the interpreter's teardown would find.
NO_SHUTDOWN = """
import atexit, sys, threading
import torch.distributed as dist
from batchgen import LLM, SamplingParams

executors = []

def report():
    worker = executors[0].processes[0]
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("batchgen"))
    print("at exit:", worker.exitcode, dist.is_initialized(), threads, flush=True)

atexit.register(report)
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32",
          max_model_len=96, page_size=4, num_kv_pages=48)
executors.append(llm.engine.executor)
outputs = llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
print("generated", len(outputs), flush=True)
del llm  # as benchmarks/engine_runs.built_engine frees it
"""


def _batchgen_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("batchgen"))


def test_shutdown_joins_the_watcher_and_drops_the_exit_hook():
    workers = Workers.spawn(answer_rank, (), 2, "gloo")
    try:
        assert workers.ask(TierMetricsQuery()) == [1]
        assert "batchgen-tp-watch" in _batchgen_threads()
    finally:
        workers.shutdown()
    # no wait of the test's: shutdown returned with the watcher ended
    assert not workers._watcher.is_alive()
    assert workers.processes[0].exitcode == 0 and workers.exited == {}
    assert not dist.is_initialized()
    # the exit hook, which holds the workers, is gone with them
    gone = weakref.ref(workers)
    del workers
    gc.collect()
    assert gone() is None


def test_a_stopped_heartbeat_beats_no_more():
    """A worker stops its heartbeat thread before it leaves (where its target raised, its
    process then tears down with no thread of ours in a store call)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    stop = start_beating("127.0.0.1", store.port, 3, 0.02, 10.0)
    deadline = time.monotonic() + 10
    while store.add(beat_key(3), 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.add(beat_key(3), 0) >= 3
    stop(10.0)
    assert "batchgen-heartbeat" not in _batchgen_threads()
    beats = store.add(beat_key(3), 0)
    time.sleep(0.2)  # ten periods
    assert store.add(beat_key(3), 0) == beats


@pytest.mark.slow
def test_a_script_that_never_shuts_its_engine_down_exits_cleanly(tmp_path):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for _ in range(2):  # the abort was a race: 1 run in 6 to 20 under CPU load
        done = subprocess.run(
            [sys.executable, "-c", NO_SHUTDOWN, str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
        assert "terminate called" not in done.stderr
        assert done.returncode == 0, done.stderr
        assert "generated 4" in done.stdout
        # before the teardown: the worker ended as told (exit code 0, not multiprocessing's
        # SIGTERM), the group left, the watcher joined
        assert "at exit: 0 False []" in done.stdout, done.stdout + done.stderr
        assert "worker exited" not in done.stderr  # the watcher saw no unexpected end
