"""Batch files for the `batchgen run` tests across ranks: a file of chat lines to run, and
the answers an output file holds, to compare one run's with another's."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_chat_batch(path: Path, n: int, max_tokens: int) -> Path:
    """n chat lines r0..r{n-1} of 2-14 random "wN" words each (the same words every call)."""
    rng = random.Random(1)
    rows = []
    for i in range(n):
        words = " ".join(f"w{rng.randint(3, 500)}" for _ in range(rng.randint(2, 14)))
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}
        rows.append({"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": body})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_answers(path: Path) -> dict[str, tuple]:
    """custom_id -> (text, finish_reason) of every answer in an output file."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        choice = rec["response"]["body"]["choices"][0]
        out[rec["custom_id"]] = (choice["message"]["content"], choice["finish_reason"])
    return out
