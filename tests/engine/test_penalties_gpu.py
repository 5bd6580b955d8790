"""Repetition, frequency and presence penalties through the engine on the GPU: decode
CUDA graphs, pipelined decode for the rows without a penalty once the penalised ones are
done, EOS endings (the checkpoint's EOS is a token the penalised runs emit mid-way), no
logprobs, debug off; with prefix-cache hits and with a pool too small for the batch, the
host tier on (tier_policy auto). The reference is tests/penalty_reference.py:
transformers' model on the same weights, penalised greedy decoding.

In float32 the engine's tokens and finish reasons must equal the reference's. In bf16
(what users run) no row may collapse under the logprob-closeness rule, endings included,
with each side's top five taken from the penalised distribution: the float32
reference's, and transformers' model in bf16 for the engine's side (it reports raw
logprobs only)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import save_tiny_model
from gpu_defaults import GPU, PathSeen
from parity import completions
from penalty_reference import cut_at, emitted_eos, penalized_greedy, penalized_top5, set_eos

from batchgen import LLM, SamplingParams
from batchgen.eval.closeness import close_under_top5

pytestmark = pytest.mark.gpu

KW = dict(page_size=16, max_model_len=256, max_num_seqs=32)
KINDS = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=1.5),
    dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4),
    dict(presence_penalty=-1.0, repetition_penalty=0.8),
    dict(),  # no penalty, and longer: decodes pipelined once the others are done
]


def _prompts() -> list[list[int]]:
    """36 prompts, six of each kind; the first 24 share a 40-token head."""
    rng = random.Random(11)
    head = [rng.randint(3, 500) for _ in range(40)]
    prompts = []
    for i in range(36):
        own = [rng.randint(3, 500) for _ in range(rng.randint(3, 60))]
        prompts.append((head if i < 24 else []) + own + rng.sample(own, k=2))
    return prompts


PROMPTS = _prompts()
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24 if k else 64, **k)
    for k in (KINDS[i % len(KINDS)] for i in range(len(PROMPTS) - 1))
] + [SamplingParams(temperature=0, max_tokens=160)]  # outlives every penalised row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama (EOS set to a token the penalised runs emit mid-way), its float32 and
    bf16 transformers models on the GPU, and each request's expected (tokens, finish
    reason) from the float32 one."""
    path = tmp_path_factory.mktemp("penalties-gpu")
    model = save_tiny_model(path, "LlamaForCausalLM").to(GPU["device"])
    free = [penalized_greedy(model, p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    eos = emitted_eos(free, avoid=free[-1])  # the last row runs to its length
    set_eos(path, eos)
    stops = {eos, 2}
    want = [cut_at(tokens, stops) for tokens in free]
    assert {r for _, r in want} == {"stop", "length"}
    half = copy.deepcopy(model).to(torch.bfloat16)
    return str(path), model, half, stops, want


def _rows(outs) -> list[tuple[list[int], str]]:
    return [(list(c.token_ids), c.finish_reason) for c in outs]


@pytest.mark.parametrize("pool", ["ample", "tight"])
def test_float32_equals_the_reference(checkpoint, pool):
    """Graphs and pipelined decode in float32: the same tokens as the reference, on two
    calls (the second hits the first's cached head), or in a pool of 20 pages that swaps."""
    path, _, _, stops, want = checkpoint
    extra = (
        dict(num_kv_pages=1024) if pool == "ample" else dict(num_kv_pages=20, host_kv_size_gib=0.1)
    )
    llm = LLM(path, **{**GPU, "dtype": "float32"}, **KW, **extra)
    assert set(llm.engine.eos_token_ids) == stops
    seen = PathSeen(llm)
    for _ in range(2):
        got = _rows(completions(llm, PROMPTS, PARAMS))
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not bad, f"rows {bad}"
    seen.check()
    m = llm.engine.metrics()
    if pool == "ample":
        assert m["prefix_hit_tokens"] >= 24 * 32, m
    else:
        assert m["tier_loads_pay"] and m["swaps_in"] > 0, m


@pytest.mark.parametrize("pool", ["ample", "tight"])
def test_bf16_stays_close_to_the_reference(checkpoint, pool):
    path, model, half, stops, want = checkpoint
    extra = (
        dict(num_kv_pages=1024) if pool == "ample" else dict(num_kv_pages=20, host_kv_size_gib=0.1)
    )
    llm = LLM(path, **GPU, **KW, **extra)
    seen = PathSeen(llm)
    outs = completions(llm, PROMPTS, PARAMS)
    seen.check()
    eos = llm.engine.eos_token_ids
    bad = []
    for i, (o, (tokens, reason)) in enumerate(zip(outs, want)):
        ours = list(o.token_ids)
        if not close_under_top5(
            ours,
            tokens,
            penalized_top5(half, PROMPTS[i], ours, PARAMS[i]),
            penalized_top5(model, PROMPTS[i], tokens, PARAMS[i]),
            a_finish=o.finish_reason,
            b_finish=reason,
            eos_ids=eos,
        ):
            bad.append(i)
    assert not bad, f"rows {bad} collapsed"
    if pool == "tight":
        m = llm.engine.metrics()
        assert m["tier_loads_pay"] and m["swaps_in"] > 0, m
