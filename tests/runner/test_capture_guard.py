"""Decode-graph capture runs under the engine's capture guard: with the host tier on,
no copy task issues CUDA work while a graph is captured (a global-mode capture fails
when another thread does). Checked on the CPU with the capture itself stubbed."""

from __future__ import annotations

import torch

from batchgen.kv.copy_engine import CopyEngine
from batchgen.runner.cuda_graphs import DecodeGraphs


def test_copies_submitted_around_a_capture_wait_for_it(monkeypatch):
    copies = CopyEngine(torch.device("cpu"))
    graphs = DecodeGraphs(
        None, [], "triton", 4, 8, 16, torch.device("cpu"), torch.float32, None, copies.paused
    )
    during = []

    def capture(self):
        handle = copies.submit("store", 0, lambda h: None)
        during.append(handle.completed.wait(0.3))
        return handle

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    graphs.capture()
    assert during == [False], "a copy ran while the graph was being captured"
