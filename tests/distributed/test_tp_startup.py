"""A tensor-parallel worker that dies while starting fails the call within seconds,
saying why and what to do, instead of leaving rank 0 in the rendezvous until its 120 s
timeout (torch's DistStoreError)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from conftest import save_tiny_model
from tp_workers import DiesWhileStarting, fails_once_joined, never_called

from batchgen.distributed.messages import PlanBegin
from batchgen.distributed.workers import RENDEZVOUS_TIMEOUT_S, Workers, WorkerStartError

# a user script that builds its LLM at top level: spawn runs it again in the worker,
# which may not start processes while it is being bootstrapped
NO_MAIN_GUARD = """
import sys
from batchgen import LLM
LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", num_kv_pages=16,
    max_model_len=32, page_size=4)
"""


def test_a_worker_that_dies_before_joining_fails_the_spawn_at_once(tmp_path):
    started = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"rank\(s\) \[1\] exited while starting") as e:
        Workers.spawn(never_called, (DiesWhileStarting(),), 2, "gloo")
    assert time.monotonic() - started < RENDEZVOUS_TIMEOUT_S / 2
    assert 'if __name__ == "__main__":' in str(e.value)
    assert not dist.is_initialized()  # rank 0 never entered the rendezvous


def test_a_worker_that_fails_once_joined_is_named_at_the_next_message():
    """Past the rendezvous the watcher sees the exit: rank 0's next message raises
    naming the rank and its exit code, not a collective's timeout."""
    workers = Workers.spawn(fails_once_joined, (), 2, "gloo")
    try:
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S / 2
        while not workers.exited and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers.exited == {1: 1}
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] stopped responding.* 1: 1"):
            workers.send(PlanBegin())
    finally:
        workers.shutdown()
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_script_without_a_main_guard_fails_within_seconds_saying_why(tmp_path):
    save_tiny_model(tmp_path / "model", "LlamaForCausalLM")
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=env,
        timeout=RENDEZVOUS_TIMEOUT_S - 20,  # the rendezvous' timeout would fail it here
    )
    took = time.monotonic() - started
    assert run.returncode != 0
    assert "WorkerStartError" in run.stderr, run.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in run.stderr
    assert "bootstrapping phase" in run.stderr  # the worker's own traceback, above it
    assert took < RENDEZVOUS_TIMEOUT_S - 20
