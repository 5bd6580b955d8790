"""The runner's own record of the running requests, kept from step to step.

A step names a request's fixed data (params, prompt, output so far, seed) once, the
first time the runner sees it (`ScheduledRequest.new`), and after that only what the
step changes: its new tokens and the pages it added. `InputBatch.apply(step)` drops the
released requests, records the new ones, appends each request's new pages to its page
row (`PageRows`) and returns the step's requests resolved (`StepRow`), in order, with
their page rows and the rows' serials as arrays (`StepRows`): what is kept per row
elsewhere (sampling parameters, a queued step's tokens) is then gathered by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.runner.batch import NewRequest, SchedulerOutput
from batchgen.runner.page_rows import PageRows
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


class StepRows(list):
    """A step's `StepRow`s in order, with `rows` [n] int64 (each one's page row) and
    `serials` [n] int64 (`PageRows.serial` of those rows as the step took them)."""

    __slots__ = ("rows", "serials")

    def __init__(self, items: list[StepRow], serial: np.ndarray) -> None:
        super().__init__(items)
        self.rows = np.fromiter((r.row for r in items), np.int64, len(items))
        self.serials = serial[self.rows]


class InputBatch:
    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.page_rows = PageRows(max_rows, max_pages)
        self._held: dict[str, tuple[NewRequest, int]] = {}  # request id -> (fixed, row)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)
        self.page_rows.release(request_ids)

    def reset(self) -> None:
        """Forget every request (the pool was re-created)."""
        self._held.clear()
        self.page_rows.reset()

    def apply(self, step: SchedulerOutput) -> StepRows:
        self.release(step.released_ids)
        held, rows, out = self._held, self.page_rows, []
        for r in step.requests:
            rid = r.request_id
            if r.new is not None:
                fixed, row = r.new, rows.add(rid, r.new_pages)
                held[rid] = fixed, row
            else:
                entry = held.get(rid)
                if entry is None:
                    raise RuntimeError(
                        f"a step continues request {rid}, which the runner never saw"
                    )
                fixed, row = entry
                if r.new_pages:
                    rows.write(rid, row, r.new_pages)
            out.append(
                StepRow(
                    rid,
                    r.new_token_ids,
                    r.start,
                    r.sample,
                    r.num_output_tokens,
                    r.state_slot,
                    fixed.params,
                    fixed.prompt_token_ids,
                    fixed.output_token_ids,
                    fixed.seed,
                    row,
                )
            )
        return StepRows(out, rows.serial)
