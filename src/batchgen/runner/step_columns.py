"""A step's sampling parameters on the host, rows as in the batch (`StepColumns`, made
by sampling_metadata.SamplingState), what the held requests use at all (`HeldFlags`),
the lazy column of request attributes it reads for a few rows only, and what makes a
request plain greedy (`plain_greedy`, which the runner's rows keep a flag of)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Temperatures below this are greedy, as in vLLM (dividing by them would overflow).
SAMPLING_EPS = 1e-5

# what a slot's parameters use (`HeldFlags`): each a bit, set where the slot's stored
# columns ask for it (`StepColumns`' reductions read the same columns)
SAMPLED, GREEDY, TOP_P, MIN_P, TOP_K, LOGPROBS, MIN_TOKENS, PENALISED = (1 << b for b in range(8))


class HeldFlags:
    """Each held slot's flags and how many held slots have each: `absent`, the bits no
    held slot has, so no step of those slots' rows needs them and a step's columns skip
    their reductions (W7's ~900 rows: no logprobs, top_k, min_p, top_p, min_tokens or
    penalties, and none greedy). Plain lists: a step releases a few slots."""

    def __init__(self) -> None:
        self._flags: list[int] = []
        self._counts = [0] * 8
        self.absent = (1 << 8) - 1

    def grow(self, slots: int) -> None:
        self._flags += [0] * slots

    def set(self, slots: list[int], floats: np.ndarray, ints: np.ndarray) -> None:
        """The slots' flags from their stored columns (floats [7, k], ints [4, k], as
        `SamplingState` keeps them), replacing what they had."""
        new = np.where(floats[0] != 0, SAMPLED, GREEDY) | np.where(floats[1] < 1.0, TOP_P, 0)
        new |= np.where(floats[2] > 0, MIN_P, 0) | np.where(floats[3] > 0, TOP_K, 0)
        new |= np.where(ints[2] >= 0, LOGPROBS, 0) | np.where(ints[1] > 0, MIN_TOKENS, 0)
        new |= np.where(ints[3] != 0, PENALISED, 0)
        self._recount(slots, new.tolist())

    def clear(self, slots: list[int]) -> None:
        self._recount(slots, [0] * len(slots))

    def _recount(self, slots: list[int], new: list[int]) -> None:
        flags, counts, moved = self._flags, self._counts, 0
        for slot, now in zip(slots, new):
            diff = flags[slot] ^ now
            flags[slot] = now
            moved |= diff
            while diff:  # each bit the slot gains or loses
                low = diff & -diff
                counts[low.bit_length() - 1] += 1 if now & low else -1
                diff ^= low
        if moved:
            self.absent = sum(1 << b for b in range(8) if not counts[b])


def plain_greedy(params) -> bool:
    """Greedy with nothing that changes or reports the distribution: the sample is the
    argmax of the raw logits (exactly what the full sampler picks for such a row)."""
    return (
        params.temperature < SAMPLING_EPS
        and params.logprobs is None
        and params.min_tokens == 0
        and not params.has_penalties
    )


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
    # `HeldFlags.absent` of the state that made them: what no row can use (0: unknown)
    absent: int = 0

    @property
    def all_greedy(self) -> bool:
        absent = self.absent if self.positions.size else 0  # no rows: all greedy
        if absent & (SAMPLED | GREEDY):
            return not absent & GREEDY
        return bool((self.floats[0] == 0.0).all())

    @property
    def max_top_k(self) -> int:
        return 0 if self.absent & TOP_K else int(self.floats[3].max(initial=0))

    @property
    def use_top_p(self) -> bool:
        return not self.absent & TOP_P and bool((self.floats[1] < 1.0).any())

    @property
    def use_min_p(self) -> bool:
        return not self.absent & MIN_P and bool((self.floats[2] > 0.0).any())

    @property
    def need_logprobs(self) -> bool:
        return not self.absent & LOGPROBS and bool((self.logprobs >= 0).any())

    @property
    def max_logprobs(self) -> int:
        return 0 if self.absent & LOGPROBS else int(self.logprobs.max(initial=0))

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
