"""Repetition, frequency and presence penalties through the engine, CPU fp32, against an
independent reference (transformers' model on the same weights, penalised greedy
decoding, tests/penalty_reference.py): greedy tokens and finish reasons identical.

Every run is in the engine's default configuration (pipeline_decode on, no logprobs, EOS
endings: the checkpoint's EOS is a token the penalised runs emit), beside rows with no
penalty that pipeline once the penalised ones are done; then with prefix-cache hits, with
preemption in a tiny pool (host tier on, tier_policy auto: swaps; tier off: recomputes),
through a batch file (`batchgen run`), and at tensor_parallel_size=2 over gloo."""

from __future__ import annotations

import json
import random

import pytest
from conftest import record_launches, save_tiny_model
from penalty_reference import cut_at, emitted_eos, penalized_greedy, set_eos

from batchgen import LLM, SamplingParams
from batchgen.api.cli import main

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=80, max_num_seqs=8)
AMPLE = dict(num_kv_pages=200, **KW)
# what one request of each kind asks; the plain rows run longer, so that once the
# penalised rows are done the rest of the batch decodes pipelined
KINDS = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=1.5),
    dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4),
    dict(presence_penalty=-1.0, repetition_penalty=0.8),  # both encourage repeats
    dict(),
]


def _params(kind: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16 if kind else 48, **kind)


def _prompts() -> list[list[int]]:
    """Twelve prompts, two of each kind; the first eight share a 12-token head (three
    pages), and every prompt repeats a few of its tokens (the repetition penalty counts
    prompt tokens)."""
    rng = random.Random(5)
    head = [rng.randint(3, 500) for _ in range(12)]
    prompts = []
    for i in range(12):
        own = [rng.randint(3, 500) for _ in range(rng.randint(2, 10))]
        own += rng.sample(own, k=min(2, len(own)))
        prompts.append((head if i < 8 else []) + own)
    return prompts


PROMPTS = _prompts()
PARAMS = [_params(KINDS[i % len(KINDS)]) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama whose EOS is a token the penalised runs emit mid-way, and each
    request's expected (tokens, finish reason) under the engine's stop tokens."""
    path = tmp_path_factory.mktemp("penalties")
    model = save_tiny_model(path, "LlamaForCausalLM")
    free = [penalized_greedy(model, p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    eos = emitted_eos(free)
    set_eos(path, eos)
    stops = {eos, 2}  # the tokenizer's </s> ends a request too
    want = [cut_at(tokens, stops) for tokens in free]
    reasons = {r for _, r in want}
    assert reasons == {"stop", "length"}, reasons
    # the penalties matter: for each kind, unpenalised greedy decoding gives other tokens
    # in some row, and so does the repetition penalty over the generated tokens alone
    # (without the prompt's), so a sampler that skipped either would be caught
    unpenalised = SamplingParams(temperature=0, max_tokens=16)
    for k, kind in enumerate(KINDS[:-1]):
        rows = range(k, len(PROMPTS), len(KINDS))
        plain = [penalized_greedy(model, PROMPTS[i], unpenalised) for i in rows]
        assert any(free[i] != t for i, t in zip(rows, plain)), kind
    rep = [i for i, sp in enumerate(PARAMS) if sp.repetition_penalty != 1.0]
    no_prompt = [penalized_greedy(model, PROMPTS[i], PARAMS[i], count_prompt=False) for i in rep]
    assert any(free[i] != t for i, t in zip(rep, no_prompt))
    return str(path), model, stops, want


def _check(outs, want) -> None:
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not bad, (
        f"rows {bad}: got {[got[i] for i in bad[:2]]}, want {[want[i] for i in bad[:2]]}"
    )


def test_default_configuration_with_prefix_hits(checkpoint):
    """Penalised rows next to plain ones; a second call takes the shared head from the
    prefix cache (its prompt tokens still count for the repetition penalty)."""
    path, _, stops, want = checkpoint
    llm = LLM(path, **AMPLE)
    assert set(llm.engine.eos_token_ids) == stops
    launches = record_launches(llm.engine.runner)
    _check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), want)
    assert any(behind for _, behind in launches), "no decode step was queued ahead"
    before = llm.engine.metrics()["prefix_hit_tokens"]
    _check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), want)
    assert llm.engine.metrics()["prefix_hit_tokens"] - before >= 8 * 12


@pytest.mark.parametrize("tier", [True, False], ids=["swaps", "recomputes"])
def test_preempted_rows_keep_their_penalties(checkpoint, tier):
    """A pool of 21 pages (the longest request takes 18): preempted requests swap to the
    host tier (tier_policy auto) and back, or, without it, are recomputed from their
    prompt and the tokens generated so far, whose counts the penalties keep."""
    path, _, _, want = checkpoint
    extra = dict(host_kv_size_gib=0.01) if tier else {}
    llm = LLM(path, num_kv_pages=21, **KW, **extra)
    _check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), want)
    m = llm.engine.metrics()
    assert m["preemptions"] > 0, m
    if tier:
        assert m["tier_loads_pay"] and m["swaps_in"] > 0 and m["recomputes"] == 0, m
    else:
        assert m["recomputes"] > 0, m


def _chat(cid: str, words: list[int], **body) -> dict:
    text = " ".join(f"w{t}" for t in words)
    body = {"messages": [{"role": "user", "content": text}], **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_batch_file_penalties(checkpoint, tmp_path):
    """`batchgen run` on chat lines whose bodies ask for penalties: each line's text is
    the text of LLM.chat's completion, whose tokens are the reference's on the chat
    prompt."""
    path, model, stops, _ = checkpoint
    kinds = [k for k in KINDS if k]
    convs = [p[-8:] for p in PROMPTS[: len(kinds)]]
    lines = [_chat(f"r{i}", c, max_tokens=16, **k) for i, (c, k) in enumerate(zip(convs, kinds))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["run", str(inp), "-o", str(out), "--model", path, "--device", "cpu"]
    assert main([*argv, "--temperature", "0", "--max-model-len", "80", "--quiet"]) == 0
    texts = {}
    for rec in map(json.loads, out.read_text().splitlines()):
        choice = rec["response"]["body"]["choices"][0]
        texts[rec["custom_id"]] = (choice["message"]["content"], choice["finish_reason"])

    llm = LLM(path, **AMPLE)
    for i, (conv, kind) in enumerate(zip(convs, kinds)):
        params = _params(kind)
        messages = [{"role": "user", "content": " ".join(f"w{t}" for t in conv)}]
        (o,) = llm.chat(messages, params, use_tqdm=False)
        c = o.outputs[0]
        assert texts[f"r{i}"] == (c.text, c.finish_reason), i
        ref = cut_at(penalized_greedy(model, list(o.prompt_token_ids), params), stops)
        assert (c.token_ids, c.finish_reason) == ref, i


@pytest.mark.slow
def test_tensor_parallel_2(checkpoint):
    """tensor_parallel_size=2 (this process rank 0, one gloo worker) on the tiny pool
    with the host tier: rank 0 samples with the penalties, the worker follows."""
    path, _, _, want = checkpoint
    llm = LLM(path, tensor_parallel_size=2, num_kv_pages=21, host_kv_size_gib=0.01, **KW)
    try:
        _check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), want)
        m = llm.engine.metrics()
    finally:
        llm.engine.shutdown()
    assert m["swaps_in"] > 0 and m["recomputes"] == 0, m
