"""`batchgen show OUTPUT`: a job's answers in custom_id order with their finish reasons,
then its error records; several-line answers indented, n samples numbered."""

from __future__ import annotations

import io
import json

from batchgen.api.cli import EXIT_USAGE, main
from batchgen.api.run_command import EXIT_FAILED_LINES
from batchgen.api.show import show


def _chat(cid: str, words: str, **body) -> dict:
    body = {"messages": [{"role": "user", "content": words}], **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_a_jobs_answers_in_custom_id_order_then_its_errors(tmp_path, tiny_llama, capsys):
    ids = ["r10", "r2", "b", "r1"]  # input order; by custom_id: b, r1, r2, r10
    rows = [json.dumps(_chat(cid, f"w{5 + i} w7", max_tokens=3)) for i, cid in enumerate(ids)]
    rows.insert(2, '{"custom_id": "bad", "method": "POST"')  # line 3: not JSON
    rows.append(json.dumps(_chat("two", "w9", max_tokens=2, temperature=0.8, n=2)))
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["run", str(inp), "-o", str(out), "--model", tiny_llama, "--device", "cpu"]
    assert main([*argv, "--kv-cache-gib", "0.02", "--quiet"]) == EXIT_FAILED_LINES
    capsys.readouterr()

    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out.splitlines()
    written = {
        json.loads(line)["custom_id"]: json.loads(line) for line in out.read_text().splitlines()
    }

    def line(cid: str, choice: dict, name: str) -> str:
        text = choice["message"]["content"].strip()
        return f"{name} ({choice['finish_reason']}): {text}".rstrip()

    want = [
        line(cid, written[cid]["response"]["body"]["choices"][0], cid)
        for cid in ["b", "r1", "r2", "r10"]
    ]
    two = written["two"]["response"]["body"]["choices"]
    want += [line("two", c, f"two #{c['index']}") for c in two]
    assert [s.rstrip() for s in shown[: len(want)]] == want
    assert len(two) == 2
    (err,) = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert err["custom_id"] is None and err["error"]["message"].startswith("line 3: ")
    assert shown[len(want)] == f"- (error): {err['error']['message']}"
    assert shown[-1] == (
        f"5 requests answered (6 completions); 1 error record in {tmp_path / 'out.errors.jsonl'}"
    )


def _record(cid: str, text: str, finish: str = "stop") -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    body = {"choices": [{**choice, "finish_reason": finish}]}
    return {"custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}


def test_a_several_line_answer_starts_below_its_name_indented(tmp_path):
    code = "```python\ndef f(s):\n\n    return s[::-1]\n```"
    out = tmp_path / "out.jsonl"
    records = [_record("code", code, "length"), _record("one", "Paris.")]
    out.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"custom_id": "torn", "re')
    text = io.StringIO()
    show(out, text)
    body = ["    " + line if line else "" for line in code.splitlines()]
    assert text.getvalue().splitlines() == [
        "code (length):",
        *body,
        "one (stop): Paris.",
        "2 requests answered; 0 error records; 1 line not JSON, left out",
    ]


def test_show_of_a_missing_file_is_a_usage_error(tmp_path, capsys):
    assert main(["show", str(tmp_path / "none.jsonl")]) == EXIT_USAGE
    assert capsys.readouterr().out == ""
