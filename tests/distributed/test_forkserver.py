"""The "mp" launcher's ranks are forks of a forkserver that imported torch and the ranks'
modules once (launchers.py). What a spawned rank had must hold for them: no CUDA state
before the rank's own (the server imports, and none of its modules may touch CUDA
there: a CUDA initialised before a fork fails in the child), and the parent's
environment, stdout and stderr as they are when the rank starts, not as they were when
the server started."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import forkserver as forkserver_module

import pytest
from tp_workers import answer_environ

from batchgen.distributed.launchers import PRELOAD, forkserver
from batchgen.distributed.messages import TierMetricsQuery
from batchgen.distributed.workers import Workers

# the CUDA calls that initialise the driver or a context, each recorded where called;
# torch made to look built with CUDA, so code that asks only on such a build asks here
RECORD_CUDA_CALLS = """
import sys
import torch

calls = []
torch.version.cuda = torch.version.cuda or "12.8"
if not hasattr(torch._C, "_cuda_getDeviceCount"):
    torch._C._cuda_getDeviceCount = lambda: 0

def recorded(owner, name):
    real = getattr(owner, name)

    def call(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    setattr(owner, name, call)

for name in ("is_available", "device_count", "init", "_lazy_init", "current_device",
             "get_device_capability", "get_device_properties", "get_device_name",
             "mem_get_info", "synchronize", "set_device"):
    recorded(torch.cuda, name)
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    if hasattr(torch._C, name):
        recorded(torch._C, name)
for module in sys.argv[1:]:
    __import__(module)
print(calls)
"""

# the modules the engines' ranks preload: PRELOAD and the targets Workers.spawn is given
RANK_MODULES = [*PRELOAD, "batchgen.engine.tp_worker", "batchgen.engine.dp_rank"]


def test_the_forkservers_modules_touch_no_cuda_at_import():
    run = subprocess.run(
        [sys.executable, "-c", RECORD_CUDA_CALLS, *RANK_MODULES],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


@pytest.fixture
def server_running() -> None:
    """The forkserver started (if no test had), before the test's own fixtures."""
    forkserver()
    forkserver_module.ensure_running()


def test_a_rank_has_the_parents_environment_and_stderr_as_at_its_start(
    server_running, monkeypatch, capfd
):
    """The server runs with the environment and the fds it started with; a variable the
    parent sets after that, and the stderr it has now (capfd's), still reach a rank."""
    monkeypatch.setenv("RANK_TEST_LATE_VARIABLE", "set after the server started")
    workers = Workers.spawn(answer_environ, ("RANK_TEST_LATE_VARIABLE",), 2, "gloo")
    try:
        assert workers.ask(TierMetricsQuery()) == ["set after the server started"]
    finally:
        workers.shutdown()
    assert "rank 1 started" in capfd.readouterr().err
