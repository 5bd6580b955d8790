"""Host page tables that persist across steps: one row per running request.

A decode step changes a request's page list by at most one page, so rebuilding every
table from Python lists each step (O(batch x pages)) is waste. Each request keeps a row
of an int64 array while it runs; a step writes only the pages added since the last
one, and the step's tables are numpy gathers of rows (copied on to the device with the
step's other inputs):

    rows (max_rows x max_pages):  row 0  | 12 13 40 41 .. |   <- request "a"
                                  row 1  | 7  9  .       |   <- request "b"
    synced[row] = (the page list mirrored, how many of its entries are written)

A row is rewritten whole when its request's page list is a different object (swap-in,
recompute, a re-created pool) or shrank; rows of released requests are reused.
"""

from __future__ import annotations

import numpy as np


class PageRows:
    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.max_rows = max_rows
        self.max_pages = max_pages
        self.table = np.zeros((max_rows, max_pages), dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self._source: list[list[int] | None] = [None] * max_rows
        self._written = [0] * max_rows

    def release(self, request_ids) -> None:
        """Free the rows of requests that finished, were preempted or aborted."""
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._source[row] = None
                self._free.append(row)

    def reset(self) -> None:
        """Free every row and zero the table (entries past a row's pages stay in range
        of a re-created, smaller pool)."""
        self.release(list(self._row_of))
        self.table[:] = 0

    def rows(self, requests) -> list[int]:
        """The row of each ScheduledRequest, its page list synced into it."""
        row_of, source, written, table = self._row_of, self._source, self._written, self.table
        new = sum(1 for r in requests if r.request_id not in row_of)
        if new > len(self._free):  # rows of requests never released: start over
            self.release(list(row_of))
        out = []
        for r in requests:
            row = row_of.get(r.request_id)
            if row is None:
                row = row_of[r.request_id] = self._free.pop()
            pages = r.page_table
            done = written[row]
            if source[row] is not pages or len(pages) < done:
                source[row], done = pages, 0
            if len(pages) > done:
                if len(pages) > self.max_pages:
                    raise ValueError(
                        f"request {r.request_id} holds {len(pages)} pages; the page table "
                        f"has room for {self.max_pages}"
                    )
                table[row, done : len(pages)] = pages[done:]
                written[row] = len(pages)
            out.append(row)
        return out
