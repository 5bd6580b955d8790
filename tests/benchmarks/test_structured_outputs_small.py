"""benchmarks/structured_outputs.py --small: the default model on the CPU extracts JSON
under a schema; every answer ends by EOS and validates, and the unconstrained run
produces the same number of tokens, request by request, without the constraint."""

from __future__ import annotations

import json

import jsonschema
import pytest
from bench_scripts import load

from batchgen import LLM


@pytest.mark.slow
def test_small_run_validates_every_answer(tmp_path, monkeypatch):
    structured_outputs = load("structured_outputs")
    calls = []  # (sampling params, outputs) of each chat call, as the engine answered it
    chat = LLM.chat

    def recording(self, conversations, params, **kw):
        outs = chat(self, conversations, params, **kw)
        calls.append((params, outs))
        return outs

    monkeypatch.setattr(LLM, "chat", recording)
    assert structured_outputs.main(["--small", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "structured_outputs.json").read_text())
    assert result["requests"] == 4 and result["ended_by_eos"] == 4 and result["invalid"] == 0
    # the warm-up, then one timed run of each kind (--small repeats once)
    (_, _), (bound, constrained), (free, unconstrained) = calls
    assert bound.structured_outputs is not None
    schema = structured_outputs.SCHEMA
    for out in constrained:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    lengths = [len(out.outputs[0].token_ids) for out in constrained]
    # each unconstrained request is free of the schema and runs to its constrained length
    assert len(free) == 4
    assert all(p.structured_outputs is None and p.max_tokens == n for p, n in zip(free, lengths))
    assert [len(out.outputs[0].token_ids) for out in unconstrained] == lengths
    assert {out.outputs[0].finish_reason for out in unconstrained} == {"length"}
    assert result["output_tokens"] == result["unconstrained_output_tokens"] == sum(lengths)
    assert sum(lengths) > 4 * 10
    answer = json.loads(result["sample"])
    assert result["sample"] == constrained[0].outputs[0].text
    assert set(answer) == set(schema["required"])
    assert result["steps"] > 0 and result["mask_fill_ms_per_step"] > 0
