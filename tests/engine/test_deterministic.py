"""deterministic=True (batch-invariant layers): each prompt's tokens and logprobs are
the same bits run alone, in a batch of mixed lengths, prefilled in chunks of 64 tokens,
after prefix-cache hits, swapped to the host tier and back, and with pipelined decode on
or off; with deterministic=False
the same runs differ (CPU, float32). A Llama and a DeepSeek-V3 (MLA, MoE) model.

The model is a tiny random Llama whose lm_head holds near-twin rows (row 256 + i is row
i nudged by a millionth): their logits differ by a few ulps, so a greedy pick between
two twins follows the rounding of its row, and a run whose rounding depends on the
batch picks other tokens. Its generation config ends rows on EOS ids the model emits.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from conftest import save_random_model, save_tiny_model
from deepseek_checkpoints import CONFIGS
from deepseek_checkpoints import tiny_config as deepseek_config

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", max_model_len=256)
NUM_PROMPTS = 24
PROBES = range(0, NUM_PROMPTS, 3)  # the prompts also run alone


@pytest.fixture(scope="module")
def twin_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("twins")
    model = save_tiny_model(path, "LlamaForCausalLM")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = model.lm_head.weight
        nudge = 1e-6 * w[:256].abs() * torch.randn(256, w.shape[1], generator=gen)
        w[256:] = w[:256] + nudge
    model.save_pretrained(path)
    # EOS: id 2 and the two ids greedy rows emit most, so that rows end on EOS
    llm = LLM(model=str(path), deterministic=True, **KW)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    common = Counter(t for o in outs for t in o.outputs[0].token_ids[2:]).most_common(2)
    file = path / "generation_config.json"
    generation = json.loads(file.read_text())
    generation["eos_token_id"] = [2, *(t for t, _ in common)]
    file.write_text(json.dumps(generation))
    return str(path)


@pytest.fixture(scope="module")
def deepseek_moe(tmp_path_factory):
    """A tiny DeepSeek-V3 of Kimi-K2's shape: MLA, a dense layer, then 8 routed experts
    (2 a token) and 2 shared ones."""
    path = tmp_path_factory.mktemp("moe")
    save_random_model(path, deepseek_config(**CONFIGS["moe_kimi_like"]))
    return str(path)


def _prompts() -> list[list[int]]:
    """Mixed lengths (2-150 tokens); every fourth starts with the same 40 tokens."""
    rng = random.Random(7)
    shared = [rng.randint(3, 500) for _ in range(40)]
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(2, 150))] for _ in range(24)]
    return [shared + p[:30] if i % 4 == 0 else p for i, p in enumerate(prompts)]


def _params(logprobs: int | None) -> list[SamplingParams]:
    """Greedy rows and sampled rows with seeds of their own."""
    return [
        SamplingParams(temperature=0, max_tokens=16, logprobs=logprobs)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, logprobs=logprobs)
        for i in range(NUM_PROMPTS)
    ]


def _row(out, logprobs: bool):
    c = out.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if logprobs else None
    return c.token_ids, c.finish_reason, lps


def _runs(model: str, deterministic: bool, logprobs: int | None) -> dict[str, list]:
    """Each run's rows of the PROBES prompts: alone (one engine call a prompt), in the
    whole batch, chunked, without pipelined decode, with a small pool swapping requests
    to the host tier, and the whole batch again on the same engine (its prompts now
    prefix-cache hits)."""
    prompts, params = _prompts(), _params(logprobs)
    want = logprobs is not None
    rows = {}

    def run(llm, note: str):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rows[note] = [_row(outs[i], want) for i in PROBES]
        return outs

    alone = LLM(model=model, deterministic=deterministic, **KW)
    rows["alone"] = [
        _row(alone.generate([prompts[i]], params[i], use_tqdm=False)[0], want) for i in PROBES
    ]
    batched = LLM(model=model, deterministic=deterministic, **KW)
    run(batched, "batch")
    before = batched.engine.metrics()["prefix_hit_tokens"]
    run(batched, "prefix hits")
    hit = batched.engine.metrics()["prefix_hit_tokens"] - before
    assert hit >= sum(map(len, prompts)) // 2, hit  # most of each prompt came from cache
    chunked = LLM(model=model, deterministic=deterministic, max_num_batched_tokens=64, **KW)
    run(chunked, "chunked 64")
    plain = LLM(model=model, deterministic=deterministic, pipeline_decode=False, **KW)
    run(plain, "pipeline off")
    # a pool of 40 pages: running requests are swapped to the host tier and back
    swapping = LLM(
        model=model,
        deterministic=deterministic,
        num_kv_pages=40,
        host_kv_size_gib=0.05,
        tier_policy="always",  # off-defaults: the tier must swap on the CPU
        **KW,
    )
    run(swapping, "tier swaps")
    assert swapping.engine.metrics()["swaps_out"] > 0
    return rows


def _differing(rows: dict[str, list]) -> dict[str, int]:
    """Per run, how many probe prompts' rows differ from the prompt run alone."""
    alone = rows["alone"]
    return {k: sum(a != b for a, b in zip(alone, v)) for k, v in rows.items() if k != "alone"}


@pytest.mark.slow
def test_tokens_and_logprobs_are_batch_invariant(twin_model):
    rows = _runs(twin_model, True, logprobs=0)  # off-defaults: logprobs are compared
    runs = ("batch", "prefix hits", "chunked 64", "pipeline off", "tier swaps")
    assert _differing(rows) == {k: 0 for k in runs}
    reasons = Counter(r[1] for r in rows["alone"])
    assert reasons["stop"] > 0 and reasons["length"] > 0  # EOS endings among them


@pytest.mark.slow
def test_without_deterministic_the_same_runs_differ(twin_model):
    """The difference deterministic=True removes exists on the CPU: every run's logprobs
    differ from the prompt alone for some prompt."""
    differ = _differing(_runs(twin_model, False, logprobs=0))  # off-defaults: logprobs
    assert all(n > 0 for n in differ.values()), differ


@pytest.mark.slow
def test_mla_and_moe_tokens_and_logprobs_are_batch_invariant(deepseek_moe):
    rows = _runs(deepseek_moe, True, logprobs=0)  # off-defaults: logprobs are compared
    assert set(_differing(rows).values()) == {0}
    differ = _differing(_runs(deepseek_moe, False, logprobs=0))  # off-defaults: logprobs
    assert all(n > 0 for n in differ.values()), differ


@pytest.mark.slow
def test_default_configuration_tokens_are_batch_invariant(twin_model):
    """Every other option at its default (prefix caching, pipelined decode, EOS ends):
    the tokens are the same; without deterministic the greedy twins' picks differ."""
    assert set(_differing(_runs(twin_model, True, None)).values()) == {0}
    differ = _differing(_runs(twin_model, False, None))
    assert any(n > 0 for n in differ.values()), differ
