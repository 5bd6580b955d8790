"""Host page tables that persist across steps: one row per running request.

A decode step adds at most one page to a request's page list, so rebuilding every
table from Python lists each step (O(batch x pages)) is waste. Each request keeps a row
of an int64 array while it runs; a step writes only the pages it adds (the step's
`new_pages`), and the step's tables are numpy gathers of rows (copied on to the device
with the step's other inputs):

    rows (max_rows x max_pages):  row 0  | 12 13 40 41 .. |   <- request "a"
                                  row 1  | 7  9  .       |   <- request "b"
    length[row]: how many of the row's entries are its pages
    serial[row]: the row's taking (1, 2, ...: each `add` a new one), so that state kept
                 by row elsewhere (runner/sampling_metadata.py) knows its holder's

A request's row is written from its first page when it is added (admitted, swapped in,
recomputed); rows of released requests are reused. A row holds max_pages rounded up to a
multiple of TABLE_ALIGN: Triton specialises an int argument on its divisibility by 16,
a table's row stride too, and a step's table is cut to such a multiple
(inputs.table_width), so any table a kernel reads has one specialisation.
"""

from __future__ import annotations

import numpy as np

TABLE_ALIGN = 16  # pages: a row's length and every step's table width are multiples


def aligned_pages(pages: int) -> int:
    """`pages` (at least 1) rounded up to a multiple of TABLE_ALIGN."""
    return -(-max(pages, 1) // TABLE_ALIGN) * TABLE_ALIGN


class PageRows:
    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.max_rows = max_rows
        self.max_pages = aligned_pages(max_pages)
        self.table = np.zeros((max_rows, self.max_pages), dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self._length = [0] * max_rows
        # per row: which taking of the row holds it now (`add` counts them), so that
        # what is kept per row elsewhere can tell a row's new holder from the last
        self.serial = np.zeros(max_rows, dtype=np.int64)
        self._taken = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row_of

    def release(self, request_ids) -> None:
        """Free the rows of requests that finished, were preempted or aborted."""
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def reset(self) -> None:
        """Free every row and zero the table (entries past a row's pages stay in range
        of a re-created, smaller pool)."""
        self.release(list(self._row_of))
        self.table[:] = 0

    def add(self, request_id: str, pages: list[int]) -> int:
        """A row for a request the table does not hold, holding `pages`."""
        self.release([request_id])
        if not self._free:
            raise RuntimeError(
                f"no page row is free for request {request_id}: {self.max_rows} rows are "
                "held by requests never released"
            )
        row = self._row_of[request_id] = self._free.pop()
        self._length[row] = 0
        self._taken += 1
        self.serial[row] = self._taken
        self.write(request_id, row, pages)
        return row

    def write(self, request_id: str, row: int, pages: list[int]) -> None:
        """Append `pages` to `row` (every page-table entry written goes through here)."""
        done = self._length[row]
        end = done + len(pages)
        if end > self.max_pages:
            raise ValueError(
                f"request {request_id} holds {end} pages; the page table has room for "
                f"{self.max_pages}"
            )
        self.table[row, done:end] = pages
        self._length[row] = end
