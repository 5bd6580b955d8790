"""`batchgen run` and LLM.chat on the same requests run the same engine steps: both feed
the engine through a window of config.read_ahead unfinished requests, refilled before each
step, so the rows of every step (which requests, which tokens) are the same, and with them
the arithmetic and the answers. Before, LLM.chat added every prompt at once while a job
keeps a window, and prefix-first admission picked other rows from the larger waiting set:
on an H100, 60 of W7's 8,192 lines differed from LLM.chat's answers."""

from __future__ import annotations

import json
import random

import pytest
from test_batch_run import _chat, _write_jsonl

from batchgen import LLM, SamplingParams
from batchgen.api import batch_file as bf
from batchgen.api.batch_job import JobOptions, run_batch_job
from batchgen.api.batch_requests import prepare_line

DEFAULTS = {"max_tokens": None, "temperature": 1.0, "top_p": 1.0}
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_size_gib=0.02)


def _lines(n: int) -> list[dict]:
    """Chat lines of their own words, except that from line 30 on each extends line 0's
    long question: once line 0 is computed they have the longest cached prefix, so
    prefix-first admission takes them ahead of earlier lines if it sees them. Lengths end
    rows at different steps; sampled at the default temperature 1.0."""
    rng = random.Random(3)

    def words(k: int) -> str:
        return " ".join(f"w{rng.randint(3, 511)}" for _ in range(k))

    first = words(64)
    asked = [first] + [words(12) for _ in range(1, 30)]
    asked += [f"{first} {words(6)}" for _ in range(30, n)]
    return [_chat(f"c{i}", w, max_tokens=4 + (i * 7) % 13) for i, w in enumerate(asked)]


def _recording(llm) -> list[list[tuple]]:
    """Each step's rows as (prompt index, first token computed, tokens computed)."""
    steps: list[list[tuple]] = []
    schedule = llm.engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(r.request_id, r.start, len(r.new_token_ids)) for r in out.requests])
        return out

    llm.engine.scheduler.schedule = recorded
    return steps


def test_a_job_and_llm_chat_run_the_same_steps(tmp_path, tiny_llama):
    lines = _lines(40)  # 2.5 windows of 16
    inp = _write_jsonl(tmp_path / "in.jsonl", lines)
    job_llm = LLM(model=tiny_llama, **ENGINE)
    job_steps = _recording(job_llm)
    opts = JobOptions(
        input=inp,
        output=tmp_path / "out.jsonl",
        model_name="tiny",
        defaults=DEFAULTS,
        max_in_flight=job_llm.engine.config.read_ahead,
        progress=False,
    )
    summary = run_batch_job(job_llm, opts)
    assert summary.succeeded == len(lines) and opts.max_in_flight < len(lines)
    answers = {}
    for rec in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines()):
        choice = rec["response"]["body"]["choices"][0]
        answers[rec["custom_id"]] = (choice["message"]["content"], choice["finish_reason"])

    chat_llm = LLM(model=tiny_llama, **ENGINE)
    params = []
    for number, line in enumerate(lines, start=1):
        item = bf.parse_line(json.dumps(line).encode(), number)
        params.append(prepare_line(chat_llm, item, DEFAULTS, 0)[2][0])
    chat_steps = _recording(chat_llm)
    outs = chat_llm.chat([line["body"]["messages"] for line in lines], params, use_tqdm=False)

    def by_prompt(steps, index_of) -> list[list[tuple]]:
        return [[(index_of(rid), start, n) for rid, start, n in step] for step in steps]

    job = by_prompt(job_steps, lambda rid: int(rid) - 1)  # a job's request id: its line
    chat = by_prompt(chat_steps, lambda rid: int(rid.rsplit("-", 1)[1]))
    assert len(job) == len(chat)
    assert job == chat
    got = {
        line["custom_id"]: (o.outputs[0].text, o.outputs[0].finish_reason)
        for line, o in zip(lines, outs)
    }
    assert got == answers


@pytest.mark.parametrize("queued", [None, 5])
def test_llm_generate_keeps_at_most_the_window_unfinished(tiny_llama, queued):
    llm = LLM(model=tiny_llama, **ENGINE, max_queued_requests=queued)
    window = llm.engine.config.read_ahead
    assert window == (queued or 4 * ENGINE["max_num_seqs"])
    held = []
    step = llm.engine.step

    def counted():
        held.append(len(llm.engine.requests))
        return step()

    llm.engine.step = counted
    prompts = [[3 + i, 40 + i, 90 + i] for i in range(3 * window + 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(outs) == len(prompts) and all(o.outputs[0].token_ids for o in outs)
    assert max(held) == window  # filled to the window, never past it
