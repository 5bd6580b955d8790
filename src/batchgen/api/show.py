"""`batchgen show OUTPUT`: a result file of `batchgen run` as people read it.

    capital-france (stop): The capital of France is Paris.
    haiku-autumn (stop):
        Crimson leaves drift down,
        ...
    2 requests answered; 1 error record in out.errors.jsonl

Answers come in custom_id order (digits compared as numbers: r2 before r10) whatever
order the job finished them in, each with its finish reason; a request's n samples as
`custom_id #i`; an answer of several lines starts on the next line, indented. Then the
error records of OUTPUT's errors file, by input line (`-` for a line without a
custom_id). Lines that are not JSON (a line
torn by a killed job, not yet repaired by a resume) are counted, not shown. Reads
nothing but the two files: no model, no torch.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TextIO

from batchgen.api.batch_journal import errors_path

INDENT = "    "


def add_show_parser(subparsers) -> argparse.ArgumentParser:
    """Add `show` to an argparse subparsers object."""
    show = subparsers.add_parser(
        "show",
        help="print a result file readably: custom_id (finish reason): answer",
        description="Print the answers of a `batchgen run` output file in custom_id order, "
        "each with its finish reason, then the error records of its .errors.jsonl file.",
    )
    show.add_argument("output", type=Path, metavar="OUTPUT", help="a `batchgen run` output file")
    return show


def show(output: Path, out: TextIO) -> None:
    """Write OUTPUT's answers, then its error records, to `out`. FileNotFoundError
    when OUTPUT does not exist."""
    records, unreadable = _records(output)
    answers = sorted((r for r in records if r.get("response")), key=_by_custom_id)
    errors = [r for r in records if not r.get("response")]  # an error record in OUTPUT
    err_file = errors_path(output)
    if err_file.is_file():
        more, skipped = _records(err_file)
        errors += more
        unreadable += skipped
    for record in answers:
        _write_answer(record, out)
    for record in sorted(errors, key=_by_line):
        error = record.get("error") or {}
        cid = record.get("custom_id")
        out.write(f"{'-' if cid is None else cid} (error): {error.get('message', error)}\n")
    tail = f"{_count(len(answers), 'request')} answered"
    completions = sum(len(r["response"].get("body", {}).get("choices", [])) for r in answers)
    if completions != len(answers):
        tail += f" ({completions} completions)"
    tail += f"; {_count(len(errors), 'error record')}"
    if errors:
        tail += f" in {err_file}"
    if unreadable:
        tail += f"; {_count(unreadable, 'line')} not JSON, left out"
    out.write(tail + "\n")


def _records(path: Path) -> tuple[list[dict], int]:
    records, unreadable = [], 0
    with path.open("rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                unreadable += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                unreadable += 1
    return records, unreadable


def _write_answer(record: dict, out: TextIO) -> None:
    choices = record["response"].get("body", {}).get("choices", [])
    cid = record.get("custom_id")
    for choice in choices:
        name = f"{cid} #{choice.get('index', 0)}" if len(choices) > 1 else str(cid)
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        text = (text or "").strip()
        head = f"{name} ({choice.get('finish_reason')}):"
        if "\n" in text:
            body = "\n".join(INDENT + line if line else line for line in text.splitlines())
            out.write(f"{head}\n{body}\n")
        else:
            out.write(f"{head} {text}\n")


def _by_custom_id(record: dict) -> list:
    parts = re.split(r"(\d+)", str(record.get("custom_id")))
    return [int(p) if i % 2 else p for i, p in enumerate(parts)]


def _by_line(record: dict) -> int:
    line = (record.get("error") or {}).get("line")
    return line if isinstance(line, int) else 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
