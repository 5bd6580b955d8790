"""The runner's own record of the running requests, kept from step to step.

A step names a request's fixed data (params, prompt, output so far, seed) once, the
first time the runner sees it (`ScheduledRequest.new`), and after that only what the
step changes: its new tokens and the pages it added. `InputBatch.apply(step)` drops the
released requests, records the new ones, appends each request's new pages to its page
row (`PageRows`) and returns the step's requests resolved (`StepRows`: each a `StepRow`
where read one by one, their per-step fields read from the step's entries as columns
where read as such), in order, with their page rows and the rows' serials as arrays:
what is kept per row elsewhere (sampling parameters, a queued step's tokens) is then
gathered by row. Whether every row of a step is plain greedy (`StepRows.plain_greedy`)
is read from a flag kept a page row, set as the row is taken, and from how many held
rows are and are not: no row's params are read for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from batchgen.runner.batch import BlindEntries, NewRequest, SchedulerOutput
from batchgen.runner.page_rows import PageRows
from batchgen.runner.step_columns import plain_greedy
from batchgen.sampling_params import SamplingParams


@dataclass(slots=True)
class StepRow:
    """One scheduled request of a step with what the runner keeps for it."""

    request_id: str
    new_token_ids: list[int]
    start: int
    sample: bool
    num_output_tokens: int
    state_slot: int | None
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # as of its admission (penalty counts fill from it)
    seed: int | None
    row: int  # its page row


class StepRows(Sequence):
    """A step's rows in order, as `StepRow`s, with `rows` [n] int64 (each one's page row)
    and `serials` [n] int64 (`PageRows.serial` of those rows as the step took them).

    `InputBatch.apply` makes it from the step's entries and what the runner holds for
    each (`of`) without a `StepRow` a row: the per-step fields are read from `entries`
    (the step's `ScheduledRequest`s, or the `StepRow`s themselves; both name them
    alike), the fixed ones from `fixed` (each row's `NewRequest`), so a decode step's
    hot readers (inputs.pack_step, pipelined_ids, sample_steps, the sampling metadata,
    the graph replay) take columns; a `StepRow` is made where a row is indexed, and
    all of them once the rows are iterated or sliced."""

    __slots__ = ("entries", "fixed", "rows", "serials", "blind", "plain", "_items", "_columns")

    def __init__(self, items: list[StepRow], serial: np.ndarray) -> None:
        # fixed: each row's fixed data (params, prompt_token_ids, output_token_ids, seed)
        self.entries = self.fixed = self._items = items
        self._columns = None
        self.blind = False  # every row one placeholder token that samples (`of`)
        # each row plain greedy as the step took it: True / False (every row alike), [n]
        # bool, or None (not known: `plain_greedy` reads the rows' params)
        self.plain: bool | np.ndarray | None = None
        self.rows = np.fromiter((r.row for r in items), np.int64, len(items))
        self.serials = serial[self.rows]

    @classmethod
    def of(
        cls,
        entries: list,
        held: Sequence[tuple[NewRequest, int]],
        serial: np.ndarray,
        blind: bool = False,
        plain=None,
    ):
        """The rows of a step's `entries`, `held` (fixed data, page row) for each;
        `blind`: every entry is one placeholder token (-1) that samples
        (`SchedulerOutput.blind`), so its token columns are known without reading it;
        `plain`: each row plain greedy, True / False for every row, a callable of the
        page rows giving either, or None (not known)."""
        self = cls.__new__(cls)
        self.entries, self._items, self._columns = entries, None, None
        self.blind = blind
        fixed, rows = zip(*held) if held else ((), ())  # one pass, in C
        self.fixed = fixed
        self.rows = np.array(rows, dtype=np.int64)
        self.serials = serial[self.rows]
        self.plain = plain(self.rows) if callable(plain) else plain
        return self

    def plain_greedy(self) -> bool:
        """Whether every row is plain greedy (`step_columns.plain_greedy` of its params):
        from the flags the step took (`plain`), else from the rows' params."""
        plain = self.plain
        if plain is None:
            return all(plain_greedy(f.params) for f in self.fixed)
        if plain is True or not len(self.entries):
            return True
        return plain is not False and bool(plain.all())

    def sampled(self) -> StepRows:
        """The rows that sample, in order, as a StepRows (itself where every row does):
        the rows a launched step's sampling, its tokens and the next step's placeholders
        read, with no `StepRow` made a row."""
        keep = self.samples()
        if keep.all():
            return self
        index = np.flatnonzero(keep)
        out = StepRows.__new__(StepRows)
        at = index.tolist()
        entries, fixed = self.entries, self.fixed
        out.entries, out.fixed = [entries[i] for i in at], [fixed[i] for i in at]
        out.rows, out.serials = self.rows[index], self.serials[index]
        out.blind, out._columns = self.blind, None
        plain = self.plain
        out.plain = plain[index] if isinstance(plain, np.ndarray) else plain
        out._items = None if self._items is None else [self._items[i] for i in at]
        return out

    def token_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(lens [n], ids [T]) int64: each row's number of new tokens, and all of them
        packed in row order; read from the entries once a step (pipelined_ids, then
        pack_step)."""
        if self._columns is None:
            n = len(self.entries)
            if self.blind:
                self._columns = np.ones(n, np.int64), np.full(n, -1, np.int64)
            else:
                self._columns = _pack_tokens(self.entries)
        return self._columns

    def samples(self) -> np.ndarray:
        """[n] bool: each row's `sample`."""
        n = len(self.entries)
        if self.blind:
            return np.ones(n, bool)
        return np.fromiter((r.sample for r in self.entries), bool, n)

    def starts(self) -> np.ndarray:
        """[n] int64: each row's `start`."""
        entries = self.entries
        if isinstance(entries, BlindEntries):
            return np.array(entries.starts, dtype=np.int64)
        return np.fromiter((r.start for r in entries), np.int64, len(entries))

    def steps(self) -> np.ndarray:
        """[n] int64: each row's output index, its output tokens on the host plus the one
        in flight where its last input is a placeholder (`in_flight.sample_steps`)."""
        n, entries = len(self.entries), self.entries
        if isinstance(entries, BlindEntries):
            out = np.array(entries.num_output_tokens, dtype=np.int64)
        else:
            out = np.fromiter((r.num_output_tokens for r in entries), np.int64, n)
        if self.blind:
            return out + 1
        lens, ids = self.token_columns()
        return out + (ids[np.cumsum(lens) - 1] == -1)

    def request_ids(self) -> list[str]:
        if isinstance(self.entries, BlindEntries):
            return list(self.entries.request_ids)
        return [r.request_id for r in self.entries]

    def items(self) -> list[StepRow]:
        """Every row as a `StepRow` (made once)."""
        if self._items is None:
            self._items = [self._row(i) for i in range(len(self.entries))]
        return self._items

    def _row(self, i: int) -> StepRow:
        r, f = self.entries[i], self.fixed[i]
        return StepRow(
            r.request_id,
            r.new_token_ids,
            r.start,
            r.sample,
            r.num_output_tokens,
            r.state_slot,
            f.params,
            f.prompt_token_ids,
            f.output_token_ids,
            f.seed,
            int(self.rows[i]),
        )

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.items())

    def __getitem__(self, i):
        if self._items is not None or isinstance(i, slice):
            return self.items()[i]
        return self._row(i)


def entries_of(reqs) -> list:
    """The per-step fields of `reqs` (a `StepRows`' entries, or the rows themselves):
    request_id, new_token_ids, start, sample, num_output_tokens, state_slot."""
    return reqs.entries if isinstance(reqs, StepRows) else reqs


def rows_of(reqs) -> np.ndarray:
    """Each row's page row, [n] int64."""
    if isinstance(reqs, StepRows):
        return reqs.rows
    return np.fromiter((r.row for r in reqs), np.int64, len(reqs))


def token_columns(reqs) -> tuple[np.ndarray, np.ndarray]:
    """`StepRows.token_columns` of `reqs`, kept by a `StepRows`."""
    return reqs.token_columns() if isinstance(reqs, StepRows) else _pack_tokens(reqs)


def samples_of(reqs) -> np.ndarray:
    """[n] bool: each row's `sample` (`StepRows.samples`)."""
    if isinstance(reqs, StepRows):
        return reqs.samples()
    return np.fromiter((r.sample for r in reqs), bool, len(reqs))


def _pack_tokens(entries) -> tuple[np.ndarray, np.ndarray]:
    """(lens [n], ids [T]) int64 of `entries`' new_token_ids."""
    lens = np.fromiter((len(r.new_token_ids) for r in entries), np.int64, len(entries))
    tokens = itertools.chain.from_iterable(r.new_token_ids for r in entries)
    return lens, np.fromiter(tokens, np.int64, int(lens.sum()))


def request_ids(reqs) -> list[str]:
    if isinstance(reqs, StepRows):
        return reqs.request_ids()
    return [r.request_id for r in reqs]


def decode_columns(reqs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page rows [n] int64, starts [n] int64, samples [n] bool) of `reqs` (a StepRows'
    from its columns)."""
    if isinstance(reqs, StepRows):
        return reqs.rows, reqs.starts(), reqs.samples()
    n = len(reqs)
    starts = np.fromiter((r.start for r in reqs), np.int64, n)
    return rows_of(reqs), starts, samples_of(reqs)


class InputBatch:
    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.page_rows = PageRows(max_rows, max_pages)
        self._held: dict[str, tuple[NewRequest, int]] = {}  # request id -> (fixed, row)
        # per page row: its holder is plain greedy (set as the row is taken); and how
        # many held rows are (`_greedy`) and are not (`_other`)
        self._plain = np.zeros(self.page_rows.max_rows, dtype=bool)
        self._greedy = self._other = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def release(self, request_ids) -> None:
        held = self._held
        for rid in request_ids:
            entry = held.pop(rid, None)
            if entry is not None:
                self._drop(entry[1])
        self.page_rows.release(request_ids)

    def reset(self) -> None:
        """Forget every request (the pool was re-created)."""
        self._held.clear()
        self._greedy = self._other = 0
        self.page_rows.reset()

    def _take(self, rid: str, new: NewRequest, pages) -> tuple[NewRequest, int]:
        """Hold `new` on a page row taken for it holding `pages` (the request's old row,
        if any, given back), its plain-greedy flag set and counted."""
        old = self._held.get(rid)
        row = self.page_rows.add(rid, pages)
        if old is not None:
            self._drop(old[1])
        plain = self._plain[row] = plain_greedy(new.params)
        if plain:
            self._greedy += 1
        else:
            self._other += 1
        entry = self._held[rid] = new, row
        return entry

    def _drop(self, row: int) -> None:
        if self._plain[row]:
            self._greedy -= 1
        else:
            self._other -= 1

    def _plain_rows(self, rows: np.ndarray):
        """Each of a step's page rows plain greedy, taken now (`StepRows.plain`): True or
        False where every held row is alike, else the rows' flags."""
        if not self._other:
            return True
        if not self._greedy:
            return False
        return self._plain[rows]

    def apply(self, step: SchedulerOutput) -> StepRows:
        self.release(step.released_ids)
        if isinstance(step.requests, BlindEntries):
            return self._apply_blind(step, step.requests)
        held, rows, got = self._held, self.page_rows, []
        for r in step.requests:
            rid = r.request_id
            if r.new is not None:
                entry = self._take(rid, r.new, r.new_pages)
            else:
                entry = held.get(rid)
                if entry is None:
                    raise RuntimeError(
                        f"a step continues request {rid}, which the runner never saw"
                    )
                if r.new_pages:
                    rows.write(rid, entry[1], r.new_pages)
            got.append(entry)
        return StepRows.of(step.requests, got, rows.serial, step.blind, self._plain_rows)

    def _apply_blind(self, step: SchedulerOutput, entries: BlindEntries) -> StepRows:
        """`apply` of a blind step: its general entries (new pages, a request new here)
        taken in row order as `apply` takes them, then every row's held data by id."""
        held, rows = self._held, self.page_rows
        for r in entries.general.values():
            rid = r.request_id
            if r.new is not None:
                self._take(rid, r.new, r.new_pages)
            elif rid in held and r.new_pages:
                rows.write(rid, held[rid][1], r.new_pages)
        ids = entries.request_ids
        try:  # the lookups in C (itemgetter of one id gives its value, not a tuple)
            got = itemgetter(*ids)(held) if len(ids) > 1 else [held[rid] for rid in ids]
        except KeyError as e:
            raise RuntimeError(
                f"a step continues request {e.args[0]}, which the runner never saw"
            ) from None
        return StepRows.of(entries, got, rows.serial, step.blind, self._plain_rows)
