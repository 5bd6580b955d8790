"""deterministic=True, a hybrid (KDA) model preempted: each request's tokens and logprobs
are the same bits as in an ample pool's run, whether a tight pool recomputes it (no host
tier) or swaps it to the host tier (the tier's cost rule left at "auto": deterministic
mode swaps anyway). A recompute computes the prompt in pieces, then replays each decoded
token as a one-token row: on CUDA the recurrent step it first took, not fla's chunked
kernel (CPU, float32; tests/engine/test_deterministic_preempt_gpu.py is the bf16 run).
"""

from __future__ import annotations

import random

import pytest
from conftest import save_random_model
from kimi_checkpoints import tiny_config

from batchgen import LLM, SamplingParams
from batchgen.layers import kda_ops

KW = dict(device="cpu", dtype="float32", max_model_len=128, deterministic=True)
TIGHT = dict(num_kv_pages=12, page_size=16)
NUM_KDA_LAYERS = 2


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    """A tiny Kimi Linear: KDA, MLA, KDA, MLA layers, a dense MLP then MoE."""
    path = tmp_path_factory.mktemp("kimi-preempt")
    save_random_model(path, tiny_config(["linear_attention", "full_attention"] * 2))
    return str(path)


def prompts_and_params(n: int = 8, max_tokens: int = 24):
    """Prompts of 20-63 tokens (a prompt is one piece: no 64k + 1 tails), greedy and
    seeded sampled rows, logprobs on."""
    rng = random.Random(5)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(20, 63))] for _ in range(n)]
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(
            temperature=0.8, seed=i, max_tokens=max_tokens, logprobs=0, ignore_eos=True
        )
        for i in range(n)
    ]
    return prompts, params


def rows(llm, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = []
    for out in outs:
        c = out.outputs[0]
        got.append((c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return got


def count_kda_rows(monkeypatch) -> dict:
    """Counts the KDA rows of each call by the kernel they take on CUDA: pieces of one
    token the recurrent step, longer ones the chunked kernel (no piece here has 64k + 1
    tokens, whose last row would step too)."""
    counts = {"chunked": 0, "recurrent": 0}
    plain = kda_ops.kda_attention

    def counted(q, k, v, g, beta, states, meta, *args, **kwargs):
        for s in meta.seqs:
            counts["chunked" if s.q_len > 1 else "recurrent"] += s.q_len
        return plain(q, k, v, g, beta, states, meta, *args, **kwargs)

    monkeypatch.setattr(kda_ops, "kda_attention", counted)
    return counts


@pytest.mark.slow
def test_recompute_and_swap_preemption_keep_tokens_and_logprobs(kimi_linear):
    prompts, params = prompts_and_params()
    ample = rows(LLM(model=kimi_linear, **KW), prompts, params)

    recompute = LLM(model=kimi_linear, **TIGHT, **KW)
    assert rows(recompute, prompts, params) == ample
    assert recompute.engine.metrics()["recomputes"] > 0

    swapping = LLM(model=kimi_linear, **TIGHT, host_kv_size_gib=0.05, **KW)
    assert rows(swapping, prompts, params) == ample
    metrics = swapping.engine.metrics()
    assert metrics["swaps_out"] > 0
    assert metrics["recomputes"] == 0  # the host had room: every preemption swapped


@pytest.mark.slow
def test_recompute_replays_decoded_tokens_as_one_token_rows(kimi_linear, monkeypatch):
    """Only prompt positions go through the chunked kernel, recomputes included: every
    other row, decoded tokens replayed after a recompute too, steps alone."""
    prompts, params = prompts_and_params()
    llm = LLM(model=kimi_linear, **TIGHT, **KW)
    counts = count_kda_rows(monkeypatch)
    rows(llm, prompts, params)
    metrics = llm.engine.metrics()
    assert metrics["recomputes"] > 0
    prompt_rows = metrics["prefill_tokens_computed"]
    assert prompt_rows > sum(len(p) for p in prompts)  # some prompts computed twice
    assert counts["chunked"] == NUM_KDA_LAYERS * prompt_rows
    decoded_rows = metrics["computed_tokens"] - prompt_rows
    assert decoded_rows > sum(p.max_tokens - 1 for p in params)  # replays among them
    assert counts["recurrent"] == NUM_KDA_LAYERS * decoded_rows
