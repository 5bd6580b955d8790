"""A step's sampling parameters on the host, rows as in the batch (`StepColumns`, made
by sampling_metadata.SamplingState), and the lazy column of request attributes it reads
for a few rows only."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepColumns:
    """A step's sampling parameters on the host, rows as in the batch
    (`SamplingState.columns`): what `SamplingState.to_device` copies to the device, and
    what a decode graph's sampler reads from its static buffers (`runner.graph_sampling`)."""

    # [7, n] float32: temperature (0: greedy), top_p, min_p, top_k (0: off), presence,
    # frequency and repetition penalties
    floats: np.ndarray
    seeds: np.ndarray  # [n] int64: each row's noise seed
    positions: np.ndarray  # [n] int64: each row's tokens generated so far
    logprobs: np.ndarray  # [n] int64: params.logprobs, -1 for None
    min_tokens_block: list[tuple[int, list[int]]]
    penalised: list[int] = field(default_factory=list)  # the rows using a penalty
    pen_ids: list[str] | None = None  # with kept counts: their request ids, slots
    pen_slots: list[int] | None = None
    outputs: list = field(default_factory=list)  # without: their (row, token ids)
    prompts: list = field(default_factory=list)

    @property
    def all_greedy(self) -> bool:
        return bool((self.floats[0] == 0.0).all())

    @property
    def max_top_k(self) -> int:
        return int(self.floats[3].max(initial=0))

    @property
    def use_min_p(self) -> bool:
        return bool((self.floats[2] > 0.0).any())

    @property
    def need_logprobs(self) -> bool:
        return bool((self.logprobs >= 0).any())

    def row_slots(self) -> np.ndarray:
        """[n] int64: each row's kept-counts slot (a row without penalties reads the
        first penalised row's, under identity penalties)."""
        out = np.full(self.positions.size, self.pen_slots[0], dtype=np.int64)
        out[self.penalised] = self.pen_slots
        return out


class LazyColumn:
    """requests[i].<name>, read where indexed (what build reads for a few rows only)."""

    __slots__ = ("name", "requests")

    def __init__(self, requests, name: str) -> None:
        self.requests, self.name = requests, name

    def __getitem__(self, i: int):
        return getattr(self.requests[i], self.name)
