"""A step's sampling parameters as device tensors (`SamplingMetadata`), built from the
running requests' parameters kept by request id (`SamplingState`), and the seeds of
requests that come without one (`request_seed`).

A row's noise seed and position (its tokens generated so far) key the counter-based
noise of `kernels.sampling`; `SamplingState` reads a request's parameters and seed once,
so a step's metadata is a gather by slot and one copy to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.forward_context import parts_to_device
from batchgen.runner.input_batch import StepRows
from batchgen.runner.penalty_counts import PenaltyCounts, token_stats
from batchgen.runner.step_columns import (
    MIN_TOKENS,
    PENALISED,
    SAMPLING_EPS,
    HeldFlags,
    LazyColumn,
    StepColumns,
)
from batchgen.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _as_int64(seed: int) -> int:
    """A seed as the int64 whose bits are seed mod 2^64 (what the noise hash reads)."""
    seed &= _MASK64
    return seed - (1 << 64) if seed >> 63 else seed


def request_seed(engine_seed: int, index: int) -> int:
    """Seed of the ``index``-th request an engine seeded with ``engine_seed`` takes that has
    no seed of its own: a 63-bit mix of both, apart from the seeds users give (it is
    derived once per request; the noise hash then mixes in the step)."""
    return _splitmix64(_splitmix64((engine_seed & _MASK64) ^ 0x5EED5EED5EED5EED) ^ index) >> 1


@dataclass
class SamplingMetadata:
    """Per-step sampling state of a batch of B rows (those of the logits), on their device.

    The ``use_*`` flags are host-side hints set by ``build`` so that unused filters cost
    nothing; leaving them True is always correct."""

    temperature: torch.Tensor  # [B] float32, 0.0 = greedy row
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = disabled
    min_p: torch.Tensor  # [B] float32
    all_greedy: bool
    seeds: torch.Tensor  # [B] int64: each row's noise seed (two's complement of seed mod 2^64)
    positions: torch.Tensor  # [B] int64: each row's tokens generated so far (the noise step)
    max_logprobs: int  # max over rows of params.logprobs (0 if none asked)
    presence_penalty: torch.Tensor | None  # [B]; the penalty fields are None when no row
    frequency_penalty: torch.Tensor | None  # [B]  of the batch uses any penalty
    repetition_penalty: torch.Tensor | None  # [B]
    min_tokens_block: list[tuple[int, list[int]]]  # (row, ids to forbid) under min_tokens
    max_top_k: int = 0  # the largest top_k of the batch (the topk taken for all rows)
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    need_logprobs: bool = True  # False: no row reports logprobs (the output's are None)
    # kept penalty counts: (penalised rows [P], their slots [P], the PenaltyCounts, ids)
    penalty_rows: tuple[torch.Tensor, torch.Tensor, PenaltyCounts, list[str]] | None = None
    # where penalised rows read their counts: (output-token counts int32, prompt-token
    # mask bool or None, rows): [B, V] each with rows None, else a PenaltyCounts' [slots,
    # V] tensors read at rows [B] (row b at slot rows[b]; nothing gathered until asked)
    penalty_source: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    @property
    def output_token_counts(self) -> torch.Tensor | None:
        """[B, V] int32 counts of each row's output tokens (None: no row is penalised);
        kept counts are gathered when asked: read it before `record` adds the step's."""
        return self._penalty_view(0)

    @property
    def prompt_token_mask(self) -> torch.Tensor | None:
        """[B, V] bool: the token appears in the row's prompt (as output_token_counts)."""
        return self._penalty_view(1)

    def _penalty_view(self, which: int) -> torch.Tensor | None:
        if self.penalty_source is None:
            return None
        t, rows = self.penalty_source[which], self.penalty_source[2]
        return t if t is None or rows is None else t.index_select(0, rows)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: list[int],
        steps: list[int] | None = None,
        seeds: list[int | None] | None = None,
        generator: torch.Generator | None = None,
        penalty_counts: PenaltyCounts | None = None,
        request_ids: list[str] | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's parameters into tensors on ``device``: a `SamplingState`
        made for this one step (the runner keeps one from step to step instead).

        ``output_token_ids[i]`` is what row i has generated so far: its length is the step
        index used for seeded noise and for ``min_tokens``, unless ``steps`` gives it
        (a pipelined step: tokens sampled but not yet on the host count). ``seeds``, when
        given, replaces each row's ``params.seed`` (the engine's per-request seeds); a
        sampled row with no seed gets one drawn from ``generator`` (a CPU generator;
        None: torch's default one). Prompt and output token ids are only read for rows
        that use a penalty: with ``penalty_counts`` (and ``request_ids``), only for a
        request it does not hold yet; the counts are then its rows on the device, and
        ``record`` adds the step's tokens to them.
        """
        state = SamplingState(vocab_size, device, eos_token_ids, generator, penalty_counts)
        ids = request_ids if request_ids is not None else [str(i) for i in range(len(params))]
        return state.build(ids, params, prompt_token_ids, output_token_ids, steps, seeds)

    def record(self, token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens [B] (on the device) in the penalised rows'
        kept counts, if they are kept (``build(..., penalty_counts=)``)."""
        if self.penalty_rows is not None:
            rows, slots, kept, request_ids = self.penalty_rows
            kept.record(request_ids, slots, token_ids.index_select(0, rows))


class SamplingState:
    """The running requests' sampling parameters, kept by request id from step to step
    (a slot a request, in host arrays), so that a step's `SamplingMetadata` is a gather
    by slot and one copy to the device: no per-row attribute reads, tuples or seeds
    made every step (at ~1,000 rows those took milliseconds of a host-bound step).

    A request is read once, at the first step that names it (or when its params object
    is another one: an id reused after its request ended); its seed then is ``seeds[i]``
    if given, else ``params.seed``, else one drawn from ``generator`` (CPU; None: torch's
    default), and stays its seed. `release(ids)` frees the slots of requests that ended.
    ``penalty_counts``: penalised rows read their kept counts there (`PenaltyCounts`)."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: list[int],
        generator: torch.Generator | None = None,
        penalty_counts: PenaltyCounts | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.generator = generator
        self.penalty_counts = penalty_counts
        self._slot: dict[str, int] = {}
        self._params: list[SamplingParams | None] = []
        self._free: list[int] = []
        # per slot: temperature (0: greedy), top_p, min_p, top_k (0: off), presence,
        # frequency and repetition penalties
        self._floats = np.zeros((7, 0), dtype=np.float32)
        # per slot: noise seed (int64 bits), min_tokens, logprobs (-1: None), penalised
        self._ints = np.zeros((4, 0), dtype=np.int64)
        self._blocked: list[list[int] | None] = []  # min_tokens' forbidden ids, when asked
        self._held = HeldFlags()  # what the held slots use: a step's columns skip the rest
        # by runner page row (`columns_for` of StepRows): its holder's slot, and the row's
        # serial then (-1: none seen)
        self._row_slot = np.zeros(0, dtype=np.int64)
        self._row_serial = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._slot)

    def release(self, request_ids) -> None:
        freed = []
        for rid in request_ids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._params[slot] = self._blocked[slot] = None
                freed.append(slot)
        if freed:
            self._held.clear(freed)
            self._free += freed

    def _take(self) -> int:
        if not self._free:
            have = len(self._params)
            grow = max(have, 64)
            self._floats = np.concatenate([self._floats, np.zeros((7, grow), np.float32)], 1)
            self._ints = np.concatenate([self._ints, np.zeros((4, grow), np.int64)], 1)
            self._params += [None] * grow
            self._blocked += [None] * grow
            self._held.grow(grow)
            self._free = list(range(have + grow - 1, have - 1, -1))
        return self._free.pop()

    def _register(self, rows, request_ids, params, seeds) -> None:
        slots, floats, ints, unseeded = [], [], [], []
        for i in rows:
            rid, p = request_ids[i], params[i]
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._slot[rid] = self._take()
            self._params[slot], self._blocked[slot] = p, None
            greedy = p.temperature < SAMPLING_EPS
            top_k = p.top_k if 0 < p.top_k < self.vocab_size else 0
            floats.append(
                ((0.0, 1.0, 0.0, 0) if greedy else (p.temperature, p.top_p, p.min_p, top_k))
                + (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            )
            seed = p.seed if seeds is None else seeds[i]
            if seed is None and not greedy:
                unseeded.append(len(slots))
            logprobs = -1 if p.logprobs is None else p.logprobs
            ints.append((_as_int64(seed or 0), p.min_tokens, logprobs, p.has_penalties))
            slots.append(slot)
        ints = np.array(ints, dtype=np.int64).reshape(-1, 4)
        if unseeded:
            drawn = torch.randint(0, 2**62, (len(unseeded),), generator=self.generator)
            ints[unseeded, 0] = drawn.numpy()
        floats = np.array(floats, dtype=np.float32).reshape(-1, 7).T
        self._floats[:, slots], self._ints[:, slots] = floats, ints.T
        self._held.set(slots, floats, ints.T)

    def _min_tokens_ids(self, slot: int) -> list[int]:
        ids = self._blocked[slot]
        if ids is None:
            p = self._params[slot]
            ids = ([] if p.ignore_eos else list(self.eos_token_ids)) + list(p.stop_token_ids)
            ids = self._blocked[slot] = sorted({t for t in ids if 0 <= t < self.vocab_size})
        return ids

    def build_for(self, requests, steps: list[int]) -> SamplingMetadata:
        """`build` for the runner's scheduled requests (each with request_id, params, seed,
        prompt_token_ids and output_token_ids) at their ``steps``: every row's id and
        params are read, a seed only for a request not held yet, token lists only for
        penalised rows."""
        return self.to_device(self.columns_for(requests, steps))

    def columns_for(self, requests, steps: list[int]) -> StepColumns:
        """`columns` for the runner's scheduled requests (read as `build_for` reads them;
        `StepRows` are gathered by page row, their ids and params read only for a row
        whose holder this state has not seen there: `_slots_by_row`)."""
        # a StepRows' fixed data and ids are read from its columns: no StepRow a row
        fixed = requests.fixed if isinstance(requests, StepRows) else requests
        prompts = LazyColumn(fixed, "prompt_token_ids")
        outputs = LazyColumn(fixed, "output_token_ids")
        seeds = LazyColumn(fixed, "seed")
        if isinstance(requests, StepRows):
            ids = LazyColumn(requests.entries, "request_id")
            at = self._slots_by_row(requests, ids, LazyColumn(fixed, "params"), seeds)
            return self._columns_at(at, ids, prompts, outputs, steps)
        ids, params = [r.request_id for r in requests], [r.params for r in requests]
        return self.columns(ids, params, prompts, outputs, steps, seeds)

    def _slots_by_row(self, requests, ids, params, seeds) -> np.ndarray:
        """Each row's slot, by page row (`requests.rows`): a row whose serial is the one
        this state saw there maps to the same request's slot (a row keeps its request
        while the runner holds it, and the request its params); the others are looked up
        (and registered) by id, as `columns` does, in row order."""
        rows, serials = requests.rows, requests.serials
        if rows.size and int(rows.max()) >= self._row_slot.size:
            more = max(int(rows.max()) + 1, 2 * self._row_slot.size) - self._row_slot.size
            self._row_slot = np.concatenate([self._row_slot, np.zeros(more, np.int64)])
            self._row_serial = np.concatenate([self._row_serial, np.full(more, -1, np.int64)])
        stale = np.flatnonzero(self._row_serial[rows] != serials)
        if stale.size:
            unseen = stale.tolist()
            get, held = self._slot.get, self._params
            new = [i for i in unseen if (s := get(ids[i], -1)) < 0 or held[s] is not params[i]]
            if new:
                self._register(new, ids, params, seeds)
            self._row_slot[rows[stale]] = [self._slot[ids[i]] for i in unseen]
            self._row_serial[rows[stale]] = serials[stale]
        return self._row_slot[rows]

    def columns(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        steps: list[int] | None = None,
        seeds: list[int | None] | None = None,
    ) -> StepColumns:
        """The step's parameters on the host (what `build` copies to the device); kept
        penalty counts of a request not held yet, or out of step, are filled here."""
        get, held = self._slot.get, self._params
        slots = [get(rid, -1) for rid in request_ids]
        new = [i for i, (s, p) in enumerate(zip(slots, params)) if s < 0 or held[s] is not p]
        if new:
            self._register(new, request_ids, params, seeds)
            slots = [self._slot[rid] for rid in request_ids]
        at = np.asarray(slots, dtype=np.int64).reshape(len(params))
        return self._columns_at(at, request_ids, prompt_token_ids, output_token_ids, steps)

    def _columns_at(self, at, request_ids, prompt_token_ids, output_token_ids, steps):
        """`columns` of the rows whose slots are `at` [n] int64."""
        n, absent = at.size, self._held.absent
        floats, ints = self._floats.take(at, axis=1), self._ints.take(at, axis=1)
        if steps is None:
            steps = [len(output_token_ids[i]) for i in range(n)]
        positions = np.asarray(steps, dtype=np.int64).reshape(n)
        min_tokens_block = []
        under = () if absent & MIN_TOKENS else np.flatnonzero(positions < ints[1]).tolist()
        for i in under:
            ids = self._min_tokens_ids(int(at[i]))
            if ids:
                min_tokens_block.append((i, ids))
        cols = StepColumns(floats, ints[0], positions, ints[2], min_tokens_block, absent=absent)
        if not absent & PENALISED:
            cols.penalised = np.flatnonzero(ints[3]).tolist()
        kept = self.penalty_counts
        if cols.penalised and kept is not None:
            cols.pen_ids = [request_ids[i] for i in cols.penalised]
            cols.pen_slots = kept.slots(
                cols.pen_ids,
                [prompt_token_ids[i] for i in cols.penalised],
                [output_token_ids[i] for i in cols.penalised],
                positions[cols.penalised].tolist(),
            )
        elif cols.penalised:  # counts built from the lists for this step alone
            cols.outputs = [(i, output_token_ids[i]) for i in cols.penalised]
            cols.prompts = [(i, prompt_token_ids[i]) for i in cols.penalised if floats[6, i] != 1]
        return cols

    def build(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        steps: list[int] | None = None,
        seeds: list[int | None] | None = None,
    ) -> SamplingMetadata:
        """The step's metadata for these rows (as `SamplingMetadata.build` describes;
        ``seeds`` and ``params`` are read only for a request not held yet)."""
        cols = self.columns(request_ids, params, prompt_token_ids, output_token_ids, steps, seeds)
        return self.to_device(cols)

    def to_device(self, cols: StepColumns) -> SamplingMetadata:
        """`columns`' step as device tensors: one copy."""
        floats, n, penalised = cols.floats, cols.positions.size, cols.penalised
        width, wide = 7 if penalised else 4, n + (-n) % 4
        # one int64 tensor crosses (parts_to_device): the float columns' bytes, seeds,
        # positions, top_k, then (penalties kept on the device) each row's slot, the
        # penalised rows and their slots. Each part, and each row of the floats (`wide`
        # floats, 16 bytes a 4), starts 16-byte aligned whatever n is: the sampling kernels
        # take them as pointers, and Triton compiles a kernel anew for each alignment
        # pattern (a tapering batch, mid-job)
        packed = np.zeros((width, wide), dtype=np.float32)
        packed[:, :n] = floats[:width]
        parts = [packed.view(np.int64), cols.seeds, cols.positions, floats[3].astype(np.int64)]
        if cols.pen_slots is not None:
            parts += [cols.row_slots(), penalised, cols.pen_slots]
        dev = parts_to_device(parts, self.device)
        rows = dev[0].view(torch.float32).view(width, wide)[:, :n].unbind(0)
        meta = SamplingMetadata(
            temperature=rows[0],
            top_p=rows[1],
            top_k=dev[3],
            min_p=rows[2],
            all_greedy=cols.all_greedy,
            seeds=dev[1],
            positions=dev[2],
            max_logprobs=cols.max_logprobs,
            presence_penalty=rows[4] if penalised else None,
            frequency_penalty=rows[5] if penalised else None,
            repetition_penalty=rows[6] if penalised else None,
            min_tokens_block=cols.min_tokens_block,
            max_top_k=cols.max_top_k,
            use_top_k=cols.max_top_k > 0,
            use_top_p=cols.use_top_p,
            use_min_p=cols.use_min_p,
            need_logprobs=cols.need_logprobs,
        )
        kept = self.penalty_counts
        if cols.pen_slots is not None:
            meta.penalty_source = (kept.counts, kept.prompt, dev[4])
            meta.penalty_rows = (dev[5], dev[6], kept, cols.pen_ids)
        elif penalised:
            counts, mask = token_stats(n, self.vocab_size, self.device, cols.outputs, cols.prompts)
            meta.penalty_source = (counts, mask, None)
        return meta
