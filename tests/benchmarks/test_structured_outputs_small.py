"""benchmarks/structured_outputs.py --small: the default model on the CPU extracts JSON
under a schema; every answer ends by EOS and validates, and the unconstrained run
produces the same number of tokens."""

from __future__ import annotations

import json

from bench_scripts import load


def test_small_run_validates_every_answer(tmp_path):
    structured_outputs = load("structured_outputs")
    assert structured_outputs.main(["--small", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "structured_outputs.json").read_text())
    assert result["requests"] == 4 and result["ended_by_eos"] == 4 and result["invalid"] == 0
    assert result["output_tokens"] == result["unconstrained_output_tokens"] > 4 * 10
    answer = json.loads(result["sample"])
    assert set(answer) == set(structured_outputs.SCHEMA["required"])
    assert result["steps"] > 0 and result["mask_fill_ms_per_step"] > 0
