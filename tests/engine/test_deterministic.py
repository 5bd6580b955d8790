"""deterministic=True (batch-invariant layers): each prompt's tokens and logprobs are
the same bits run alone, in a batch of mixed lengths, prefilled in chunks of 64 tokens,
after prefix-cache hits, swapped to the host tier and back, and with pipelined decode on
or off; with deterministic=False the same runs differ (CPU, float32). A Llama and a
DeepSeek-V3 (MLA, MoE) and a Kimi Linear (KDA, MLA, MoE) model.

The Llama is twin_checkpoints' (near-tie logits: a run whose rounding depends on the
batch picks other greedy tokens; rows end on EOS ids the model emits).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import save_random_model
from deepseek_checkpoints import CONFIGS
from deepseek_checkpoints import tiny_config as deepseek_config
from deterministic_cases import mixed_params, mixed_prompts, row
from kimi_checkpoints import tiny_config as kimi_config
from twin_checkpoints import save_twin_model

from batchgen import LLM

KW = dict(device="cpu", dtype="float32", max_model_len=256)
NUM_PROMPTS = 24
PROBES = range(0, NUM_PROMPTS, 3)  # the prompts also run alone


@pytest.fixture(scope="module")
def twin_model(tmp_path_factory):
    return save_twin_model(tmp_path_factory.mktemp("twins"), _prompts())


@pytest.fixture(scope="module")
def deepseek_moe(tmp_path_factory):
    """A tiny DeepSeek-V3 of Kimi-K2's shape: MLA, a dense layer, then 8 routed experts
    (2 a token) and 2 shared ones."""
    path = tmp_path_factory.mktemp("moe")
    save_random_model(path, deepseek_config(**CONFIGS["moe_kimi_like"]))
    return str(path)


def _prompts() -> list[list[int]]:
    return mixed_prompts(7, NUM_PROMPTS)


def _runs(
    model: str, deterministic: bool, logprobs: int | None, hybrid: bool = False, **options
) -> dict[str, list]:
    """Each run's rows of the PROBES prompts: alone (one engine call a prompt), in the
    whole batch, chunked, without pipelined decode, with a small pool swapping requests
    to the host tier, and the whole batch again on the same engine (its prompts now
    prefix-cache hits; a `hybrid` model's resume from the KDA state checkpointed to the
    host every 64 tokens). `options`: given to every engine."""
    kw = KW | options
    prompts, params = _prompts(), mixed_params(NUM_PROMPTS, 16, logprobs)
    want = logprobs is not None
    rows = {}

    def run(llm, note: str):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rows[note] = [row(outs[i], want) for i in PROBES]
        return outs

    alone = LLM(model=model, deterministic=deterministic, **kw)
    rows["alone"] = [
        row(alone.generate([prompts[i]], params[i], use_tqdm=False)[0], want) for i in PROBES
    ]
    checkpoints = dict(
        host_kv_size_gib=0.05, state_checkpoint_interval=64, state_checkpoint_policy="all"
    )
    batched = LLM(model=model, deterministic=deterministic, **(checkpoints if hybrid else {}), **kw)
    run(batched, "batch")
    metric = "state_checkpoint_hit_tokens" if hybrid else "prefix_hit_tokens"
    before = batched.engine.metrics()[metric]
    run(batched, "prefix hits")
    hit = batched.engine.metrics()[metric] - before
    # most of each prompt came from cache (a hybrid's: its 64-token multiples)
    assert hit >= sum(len(p) // 64 * 64 if hybrid else len(p) for p in prompts) // 2, hit
    chunked = LLM(model=model, deterministic=deterministic, max_num_batched_tokens=64, **kw)
    run(chunked, "chunked 64")
    plain = LLM(model=model, deterministic=deterministic, pipeline_decode=False, **kw)
    run(plain, "pipeline off")
    # a pool of 40 pages: running requests are swapped to the host tier and back
    swapping = LLM(
        model=model,
        deterministic=deterministic,
        num_kv_pages=40,
        host_kv_size_gib=0.05,
        tier_policy="always",  # off-defaults: the tier must swap on the CPU
        **kw,
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


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    """A tiny Kimi Linear: KDA, MLA, KDA, MLA layers, a dense MLP then MoE."""
    path = tmp_path_factory.mktemp("kimi")
    layers = ["linear_attention", "full_attention"] * 2
    save_random_model(path, kimi_config(layers))
    return str(path)


@pytest.mark.slow
def test_kda_tokens_and_logprobs_are_batch_invariant(kimi_linear):
    """KDA's chunked math depends on where chunks start: a cut-short prefill ends at a
    multiple of 64 from the sequence's start, decode rows take the chunked path too, and
    a prefix hit resumes from a checkpoint on a multiple of 64."""
    rows = _runs(kimi_linear, True, logprobs=0, hybrid=True)  # off-defaults: logprobs
    assert set(_differing(rows).values()) == {0}
    differ = _differing(_runs(kimi_linear, False, logprobs=0, hybrid=True))  # off-defaults
    assert all(n > 0 for n in differ.values()), differ


@pytest.mark.slow
def test_default_configuration_tokens_are_batch_invariant(twin_model):
    """Every other option at its default (prefix caching, pipelined decode, EOS ends):
    the tokens are the same; without deterministic the greedy twins' picks differ."""
    assert set(_differing(_runs(twin_model, True, None)).values()) == {0}
    differ = _differing(_runs(twin_model, False, None))
    assert any(n > 0 for n in differ.values()), differ


@pytest.mark.slow
def test_fp8_kv_tokens_and_logprobs_are_batch_invariant(twin_model):
    """kv_cache_dtype="fp8": K/V rounded to e4m3 as they are written, the same bytes
    whatever the batch, so deterministic=True holds with FP8 pages too, swapped through
    the host tier as they are."""
    fp8 = LLM(model=twin_model, deterministic=True, kv_cache_dtype="fp8", **KW)
    assert fp8.engine.pool.kv.dtype == torch.float8_e4m3fn
    rows = _runs(twin_model, True, logprobs=0, kv_cache_dtype="fp8")  # off-defaults: logprobs
    assert set(_differing(rows).values()) == {0}
    reasons = Counter(r[1] for r in rows["alone"])
    assert reasons["stop"] > 0 and reasons["length"] > 0
