"""What a batch job makes of its input: lines with no runnable request, unknown keys,
a max_tokens beyond the context, lines fixed in place, and another input's journal."""

from __future__ import annotations

import json

import pytest
from test_batch_run import _answers, _chat, _cli, _read, _write_jsonl

from batchgen.api.batch_job import JobOptions, answered_earlier
from batchgen.api.batch_journal import InputMismatch, input_record_path
from batchgen.api.cli import main


def _opts(inp, out) -> JobOptions:
    return JobOptions(inp, out, "tiny", progress=False)


def test_answered_earlier_says_what_it_found_when_nothing_can_run(tmp_path):
    out = tmp_path / "out.jsonl"
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    summary = answered_earlier(_opts(empty, out))
    assert summary is not None and summary.note == "the input is empty"
    assert (summary.succeeded, summary.failed) == (0, 0) and not out.exists()

    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{oops", _chat("a", "w5", max_token=3), "[]"])
    summary = answered_earlier(_opts(bad, out))
    errs = tmp_path / "out.errors.jsonl"
    assert summary.failed == 3
    assert summary.note == f"3 lines, none runnable: 3 bad lines (error records in {errs})"
    assert [e["error"]["line"] for e in _read(errs)] == [1, 2, 3]
    again = answered_earlier(_opts(bad, out))  # now answered by those records
    assert (again.failed, again.failed_earlier, again.note) == (0, 3, "")

    runnable = _write_jsonl(tmp_path / "ok.jsonl", ["{oops", _chat("a", "w5")])
    assert answered_earlier(_opts(runnable, tmp_path / "other.jsonl")) is None
    assert not (tmp_path / "other.errors.jsonl").exists()


def test_unknown_keys_and_overlong_max_tokens_are_error_records(tmp_path, tiny_llama, caplog):
    rows = [
        _chat("typo", "w5", max_token=5),
        _chat("long", "w5 w6", max_tokens=1023),  # the prompt's tokens + 1023 > 1024
        _chat("fits", "w5 w6", max_tokens=2, user="u1", store=False),
        _chat("fits2", "w7", max_tokens=2, user="u2"),
    ]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out)) == 1
    assert sorted(_answers(out)) == ["fits", "fits2"]
    errors = {e["custom_id"]: e["error"]["message"] for e in _read(tmp_path / "out.errors.jsonl")}
    assert "unknown body field 'max_token'; did you mean 'max_tokens'?" in errors["typo"]
    assert "max_tokens is 1023" in errors["long"] and "> max_model_len 1024" in errors["long"]
    warnings = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per key per job: user, store
    assert any("body.user (first on line 3)" in w for w in warnings)


def test_a_failed_line_fixed_in_place_runs_again(tmp_path, tiny_llama):
    rows = [
        _chat("a", "w5", max_tokens=2),
        _chat("b", "w6", max_token=2),
        _chat("c", "w7", max_tokens=2),
    ]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, inp, out)) == 1
    assert sorted(_answers(out)) == ["a", "c"]
    rows[1] = _chat("b", "w6", max_tokens=2)  # the typo fixed
    _write_jsonl(inp, rows)
    assert main(_cli(tiny_llama, inp, out)) == 0
    assert sorted(_answers(out)) == ["a", "b", "c"]
    assert main(_cli(tiny_llama, inp, out)) == 0  # the stale record no longer counts


def test_another_inputs_journal_is_refused_and_digests_keep_skips_true(tmp_path, tiny_llama):
    first = _write_jsonl(tmp_path / "a.jsonl", ["{bad", "{bad again", "[1]"])
    out = tmp_path / "out.jsonl"
    assert main(_cli(tiny_llama, first, out)) == 1  # three error records, by line number
    other = _write_jsonl(
        tmp_path / "b.jsonl", [_chat(f"o{i}", f"w{9 + i}", max_tokens=2) for i in range(3)]
    )
    with pytest.raises(InputMismatch, match="another input"):
        answered_earlier(_opts(other, out))

    input_record_path(out).unlink()  # a journal written before inputs were recorded
    assert answered_earlier(_opts(other, out)) is None  # its error records answer other lines
    assert main(_cli(tiny_llama, other, out)) == 0
    assert sorted(_answers(out)) == ["o0", "o1", "o2"]
    assert json.loads(input_record_path(out).read_text())["input"] == str(other.resolve())
