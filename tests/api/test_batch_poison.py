"""A poison line (valid, but a step fails for it) fails alone: its error record names
it, the other lines complete, the job exits 1 and a rerun does not admit it again."""

from __future__ import annotations

import json

import pytest
from conftest import save_byte_tokenizer, save_tiny_model
from planted_errors import grammar_fails_for, step_until_done
from test_batch_run import _answers, _chat, _cli, _read, _write_jsonl

from batchgen.api.batch_journal import suspects_path
from batchgen.api.cli import main
from batchgen.engine.engine_core import EngineCore, RequestsFailed


@pytest.fixture(scope="module")
def spelling(tmp_path_factory) -> str:
    """A tiny model whose tokenizer can spell JSON (structured outputs need it)."""
    path = tmp_path_factory.mktemp("bytes")
    save_tiny_model(path, "LlamaForCausalLM")
    save_byte_tokenizer(path)
    return str(path)


def test_a_grammar_error_at_run_time_fails_its_line_alone(tmp_path, spelling, monkeypatch):
    rows = [
        _chat(f"j{i}", f"row {i}", response_format={"type": "json_object"}, max_tokens=40)
        for i in range(6)
    ]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    taken = grammar_fails_for(monkeypatch, poison="3")  # line 3: custom_id j2
    assert main(_cli(spelling, inp, out)) == 1
    assert len(taken) > 3, "the planted error should have fired"
    assert sorted(_answers(out)) == ["j0", "j1", "j3", "j4", "j5"]
    errors = _read(tmp_path / "out.errors.jsonl")
    assert len(errors) == 1
    error = errors[0]
    assert error["custom_id"] == "j2" and error["error"]["line"] == 3
    assert error["error"]["code"] == "engine_error"
    assert "planted matcher error" in error["error"]["message"]

    before = out.read_bytes()
    assert main(_cli(spelling, inp, out)) == 1  # the rerun does not admit it again
    assert out.read_bytes() == before
    assert len(_read(tmp_path / "out.errors.jsonl")) == 1


def test_engine_step_drops_the_failed_request_and_keeps_the_others(spelling, monkeypatch):
    """RequestsFailed: the failed request is gone, the others finish, and the requests
    the failing step finished come out of the next step()."""
    from batchgen.api.llm import LLM
    from batchgen.sampling_params import SamplingParams, StructuredOutputsParams

    llm = LLM(model=spelling, device="cpu", kv_cache_size_gib=0.02, max_num_seqs=4)
    engine = llm.engine
    constrained = SamplingParams(
        max_tokens=30, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    for rid in ("a", "poison", "b"):
        engine.add_request(rid, [5, 6, 7], constrained)
    engine.add_request("short", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    grammar_fails_for(monkeypatch, poison="poison", after=2)  # "short" ends in that step
    finished, failures = step_until_done(engine)
    assert [e.request_ids for e in failures] == [["poison"]]
    assert "planted matcher error" in str(failures[0])
    assert sorted(finished) == ["a", "b", "short"]
    assert "poison" not in engine.requests and not engine.grammar.constrains(["poison"])


def test_requests_the_failing_step_finished_come_out_of_the_next_step(spelling, monkeypatch):
    """The failing step also finished the last other request: the engine still has it
    to hand out, and the next step() does."""
    from batchgen.api.llm import LLM
    from batchgen.sampling_params import SamplingParams, StructuredOutputsParams

    llm = LLM(model=spelling, device="cpu", kv_cache_size_gib=0.02, max_num_seqs=4)
    engine = llm.engine
    constrained = SamplingParams(
        max_tokens=30, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    engine.add_request("poison", [5, 6, 7], constrained)
    engine.add_request("short", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    grammar_fails_for(monkeypatch, poison="poison", after=2)  # fails on its 3rd token
    finished = []
    with pytest.raises(RequestsFailed):
        while engine.has_unfinished:
            finished += engine.step()
    assert finished == [] and engine.has_unfinished
    assert [r.request_id for r in engine.step()] == ["short"]
    assert not engine.has_unfinished


def test_an_error_naming_no_request_runs_the_lines_in_flight_alone_on_the_rerun(
    tmp_path, tiny_llama, monkeypatch
):
    """A step that fails naming no request (a kernel error) stops the job (exit 4) with
    the lines in flight noted; the rerun runs each alone, so the poison line fails
    alone (error record) and every other line is answered once (exit 1)."""
    rows = [_chat(f"k{i}", f"w{7 + i} w9", max_tokens=12) for i in range(20)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    real = EngineCore._finish_step

    def finish_step(self, sched, result):
        if any(r.request_id == "5" for r in sched.requests):
            raise RuntimeError("planted kernel error")
        return real(self, sched, result)

    monkeypatch.setattr(EngineCore, "_finish_step", finish_step)
    argv = _cli(tiny_llama, inp, out, "--max-num-seqs", "4")
    assert main(argv) == 4
    noted = json.loads(suspects_path(out).read_text())
    assert "5" in noted["lines"] and "planted kernel error" in noted["error"]

    assert main(argv) == 1
    assert not suspects_path(out).exists()
    answers = _answers(out)
    assert sorted(answers) == sorted(f"k{i}" for i in range(20) if i != 4)
    errors = _read(tmp_path / "out.errors.jsonl")
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [("k4", 5)]
    assert "when run alone" in errors[0]["error"]["message"]
    assert "planted kernel error" in errors[0]["error"]["message"]

    assert main(argv) == 1  # nothing left to run: the poison line is not admitted again
    assert _answers(out) == answers
