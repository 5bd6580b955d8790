"""`batchgen run` on the GPU, as users run it: a subprocess with --device cuda on the
default model (bf16, decode CUDA graphs, pipelined decode), chat lines that are greedy,
sampled with the run's seed, sampled with a seed of their own, or stopped by a stop
string, ending on EOS, stop strings and their length. Each output line's text and finish
reason must equal LLM.chat's on the same requests with the same per-sample seeds
(batch_requests.prepare_line derives them from the run's seed and the line's custom_id),
in an engine built as the command builds it; the batch runs the same steps, so bf16 gives
the same tokens."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_defaults import GPU, PathSeen
from prompts import QUESTIONS

from batchgen import LLM

pytestmark = pytest.mark.gpu

SRC = str(Path(__file__).resolve().parents[2] / "src")
SEED, MAX_TOKENS, KV_GIB = 7, 96, 4.0


STOPS = {1: "\n", 8: "\n", 0: " is", 15: " is", 16: " is"}  # line -> its stop string
SAMPLED, SEEDED = {6, 7, 9, 11}, {12, 13, 14}


def _lines() -> list[dict]:
    """One chat line a question: greedy, or sampled with the run's seed (SAMPLED) or
    with a seed of its own (SEEDED); some stopped by a stop string (STOPS); every fourth
    capped at 24 tokens."""
    lines = []
    for i, question in enumerate(QUESTIONS):
        body = {"messages": [{"role": "user", "content": question}], "temperature": 0}
        if i in SAMPLED | SEEDED:
            body.update(temperature=0.8, top_p=0.95)
        if i in SEEDED:
            body["seed"] = 1000 + i
        if i in STOPS:
            body["stop"] = [STOPS[i]]
        if i % 4 == 3:
            body["max_tokens"] = 24
        url = "/v1/chat/completions"
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": url, "body": body})
    return lines


def test_batch_run_equals_llm_chat(tmp_path):
    from batchgen.api import batch_file as bf
    from batchgen.api.batch_requests import prepare_line

    lines = _lines()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    gc.collect()
    if torch.cuda.is_available():  # what this process holds is not the subprocess's to use
        torch.cuda.empty_cache()
    argv = [
        "run", str(inp), "-o", str(out), "--device", GPU["device"], "--seed", str(SEED),
        "--max-tokens", str(MAX_TOKENS), "--kv-cache-gib", str(KV_GIB), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", *argv], env=env, capture_output=True, timeout=600
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    answers = {}
    for rec in map(json.loads, out.read_text().splitlines()):
        choice = rec["response"]["body"]["choices"][0]
        answers[rec["custom_id"]] = (choice["message"]["content"], choice["finish_reason"])
    assert sorted(answers) == sorted(line["custom_id"] for line in lines)

    llm = LLM(device=GPU["device"], seed=SEED, kv_cache_size_gib=KV_GIB)
    seen = PathSeen(llm)
    defaults = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 1.0}
    params = []
    for n, line in enumerate(lines, start=1):
        item = bf.parse_line(json.dumps(line).encode(), n)
        _, _, (child,) = prepare_line(llm, item, defaults, SEED)
        params.append(child)
    assert all(p.seed is not None for p in params if not p.greedy)
    convs = [line["body"]["messages"] for line in lines]
    outs = [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]
    seen.check()
    got = {line["custom_id"]: (c.text, c.finish_reason) for line, c in zip(lines, outs)}
    differ = [cid for cid in got if got[cid] != answers[cid]]
    assert not differ, [(cid, answers[cid], got[cid]) for cid in differ[:3]]
    reasons = [c.finish_reason for c in outs]
    assert "stop" in reasons and "length" in reasons, reasons
    assert any(c.stop_reason in STOPS.values() for c in outs), "no stop-string ending"
