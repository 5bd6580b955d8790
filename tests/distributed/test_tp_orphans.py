"""A tensor-parallel job whose rank 0 is killed leaves no worker behind: each worker's
next message or collective fails as rank 0's connections close, and (NCCL) it aborts the
collectives it queued (a replayed graph's would wait forever on rank 0) before leaving
the group. A worker left running would hold its GPU, and a rerun resuming the job would
find it taken."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model

RANK_0 = """
import sys
from batchgen import LLM, SamplingParams
model, device = sys.argv[1], sys.argv[2]
pool = {"num_kv_pages": 48} if device == "cpu" else {}
llm = LLM(model, tensor_parallel_size=2, device=device, dtype="float32", max_model_len=96,
          page_size=4, **pool)
print(llm.engine.executor.processes[0].pid, flush=True)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
while True:
    llm.generate([[5, 6, 7, 8]] * 8, params, use_tqdm=False)
    print("generated", flush=True)
"""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts: it holds nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _lines(stream, into: list) -> None:
    for line in stream:
        into.append(line.strip())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
            ],
        ),
    ],
)
def test_killing_rank_0_mid_run_ends_its_worker(tmp_path, device):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK_0, str(tmp_path), device],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    threading.Thread(target=_lines, args=(rank0.stdout, lines), daemon=True).start()
    worker = None
    try:
        deadline = time.monotonic() + 240
        while lines.count("generated") < 2 and time.monotonic() < deadline:
            assert rank0.poll() is None, f"rank 0 ended early: {lines}"
            time.sleep(0.1)
        assert lines.count("generated") >= 2, lines
        worker = int(lines[0])
        assert not _gone(worker)
        rank0.kill()  # mid-generate: the worker is in a step or waiting for the next
        rank0.wait(30)
        deadline = time.monotonic() + 60
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), "the worker outlived rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()
        if worker is not None and not _gone(worker):
            os.kill(worker, 9)
