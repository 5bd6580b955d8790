"""Host int64 arrays to the device in one copy per step, through reused pinned buffers."""

from __future__ import annotations

import numpy as np
import torch

_RING = 8  # buffers in turn: a step stages up to three arrays and one step may be queued


class HostStaging:
    """`stage(array)` returns the array as an int64 tensor on the device.

    On CUDA it goes through a ring of pinned buffers and a non-blocking copy; a buffer
    is written again only after the event of its last copy has completed, so a step that
    syncs on nothing cannot overwrite memory a copy still reads. On the CPU the array's
    memory is wrapped as it is (the caller hands over a fresh array).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * _RING
        self._events: list[torch.cuda.Event | None] = [None] * _RING
        self._turn = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array, dtype=np.int64)
        if not self._cuda:
            return torch.from_numpy(array)
        self._turn = i = (self._turn + 1) % _RING
        if self._events[i] is not None:
            self._events[i].synchronize()
        buf = self._buffers[i]
        if buf is None or buf.numel() < array.size:
            size = max(array.size, 2 * (buf.numel() if buf is not None else 4096))
            buf = self._buffers[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host = buf[: array.size]
        host.numpy()[:] = array
        out = host.to(self.device, non_blocking=True)
        event = self._events[i] = torch.cuda.Event()
        event.record()
        return out
