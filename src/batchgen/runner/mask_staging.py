"""Host rows for a step's structured-output bitmask and their copy to the device.

A step's masks are [rows, words] int32 (1.5 MiB at batch 256 on a 49k vocabulary). They
are filled straight into one pinned buffer, kept for the engine's life, and copied into
one device buffer, also kept: no per-step allocation and no extra host copy.

    fill (host, engine thread)       copy (stream)          apply (stream)
    rows(n) -> pinned[:n] ---------> device[:n] ----------> logits masked
          waits for `_copied` of     records `_copied`      after the copy, in
          the previous copy                                 stream order

The pinned rows are written again only after the event of their last copy has passed,
so a step that syncs on nothing cannot overwrite what a copy still reads; the device
rows are overwritten by a copy queued on the same stream as the apply that read them,
so stream order keeps that apply first. On the CPU there is no copy: `upload` returns
the filled rows themselves.
"""

from __future__ import annotations

import numpy as np
import torch


class MaskStaging:
    """`rows(n)` -> the host rows to fill; `upload(n)` -> those rows on the device."""

    def __init__(self, device: torch.device, words: int, capacity: int) -> None:
        self.device = device
        self.words = words
        self.capacity = capacity  # rows allocated at first use (max_num_seqs)
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def rows(self, n: int) -> np.ndarray:
        """[>= n, words] int32 host rows, free to write (grown when n exceeds them)."""
        if self._host is None or self._host.shape[0] < n:
            self.capacity = max(n, self.capacity)
            shape = (self.capacity, self.words)
            self._host = torch.empty(shape, dtype=torch.int32, pin_memory=self._cuda)
            self._device = None
            self._copied = None  # the old buffer is dropped, not written
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.numpy()

    def upload(self, n: int) -> torch.Tensor:
        """The first n rows, as `rows` filled them, on the device ([n, words] int32)."""
        host = self._host[:n]
        if not self._cuda:
            return host
        if self._device is None:
            self._device = torch.empty(self._host.shape, dtype=torch.int32, device=self.device)
        out = self._device[:n]
        out.copy_(host, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()  # re-recorded each step: it marks the latest copy only
        return out
