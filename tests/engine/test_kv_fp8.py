"""FP8 KV pages (kv_cache_dtype="fp8") end to end on the CPU, in the configuration users
run: pipelined decode, EOS endings, no logprobs, greedy rows beside seeded sampled rows,
the host tier at its default policy, debug off.

For a tiny DeepSeek-V3 (MLA: the latent in FP8) and a tiny Qwen3 (K and V in FP8):
- a pool too small for the batch swaps FP8 pages through the host tier, and every row,
  greedy or sampled, comes out as on an ample FP8 pool (the tier moves the bytes as
  they are);
- no greedy row collapses under the logprob-closeness rule (eval/closeness.py), endings
  included, against the same model with float32 KV asked for five logprobs a step.
The default model (SmolLM2-135M, slow) is held to the same rule on chat prompts.
A page of FP8 takes half a bf16 page's bytes: the memory plan gives twice the pages for
the same budget, and `batchgen plan`'s "fp8 KV" column counts the same bytes a token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batch_cases import greedy_and_sampled, prefix_prompts
from conftest import record_launches, save_tiny_model
from deepseek_checkpoints import save_tiny_deepseek
from gpu_defaults import collapsed_rows
from parity import completions
from penalty_reference import emitted_eos, set_eos

from batchgen import LLM, SamplingParams
from batchgen.kv_quant import FP8

MAX_NEW = 16
RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, max_num_seqs=8)
AMPLE = 400
JUDGE = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)  # off-defaults: judge


def _save(kind: str, path) -> str:
    if kind == "deepseek_v3":
        save_tiny_deepseek(path, first_k_dense_replace=1)
    else:
        save_tiny_model(path, "Qwen3ForCausalLM")
    return str(path)


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3"])
def model(request, tmp_path_factory):
    """The checkpoint with its EOS set to a token the float32-KV run emits mid-way in
    the most rows, the prompts, and the float32-KV reference under that EOS."""
    path = _save(request.param, tmp_path_factory.mktemp(f"kv-fp8-{request.param}"))
    prompts = prefix_prompts(12, 500)
    free = completions(LLM(path, num_kv_pages=AMPLE, **RUN), prompts, JUDGE)
    set_eos(Path(path), emitted_eos([list(c.token_ids) for c in free]))
    ref_llm = LLM(path, num_kv_pages=AMPLE, **RUN)
    ref = completions(ref_llm, prompts, JUDGE)
    assert {c.finish_reason for c in ref} == {"stop", "length"}
    return path, prompts, ref, ref_llm.engine.eos_token_ids


def test_fp8_pages_swap_and_stay_close_to_float32_kv(model):
    path, prompts, ref, eos = model
    params = greedy_and_sampled(len(prompts), MAX_NEW)
    ample = LLM(path, num_kv_pages=AMPLE, kv_cache_dtype="fp8", **RUN)
    assert ample.engine.pool.kv.dtype == FP8
    want = completions(ample, prompts, params)
    tight = LLM(path, num_kv_pages=20, host_kv_size_gib=0.01, kv_cache_dtype="fp8", **RUN)
    assert tight.config.tier_policy == "auto" and not tight.config.batchgen_debug
    assert tight.engine.tier.host_pool.kv.dtype == FP8
    launches = record_launches(tight.engine.runner)
    got = completions(tight, prompts, params)
    m = tight.engine.metrics()
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0, m
    assert m["recomputes"] == 0 and m["readback_checks"] == 0, m
    assert any(behind for _, behind in launches), "no decode step was queued ahead"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a.token_ids != b.token_ids]
    assert not bad, f"rows {bad} changed when their FP8 pages crossed the host tier"
    assert {c.finish_reason for c in got} == {"stop", "length"}
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    outs = [got[i] for i in greedy]
    bad = collapsed_rows(tight, [prompts[i] for i in greedy], outs, [ref[i] for i in greedy], eos)
    assert not bad, f"greedy rows {[greedy[i] for i in bad]} collapsed against float32 KV"


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3"])
def test_fp8_pages_take_half_the_bytes_of_bf16_pages(kind, tmp_path):
    """The same KV budget: twice the pages in FP8 as in bf16, and the engine's bytes a
    token are `batchgen plan`'s fp8 KV column."""
    from transformers import AutoConfig

    from batchgen.api.plan import KV_DTYPES, Parallel, kv_layout

    path = _save(kind, tmp_path)
    run = dict(RUN, dtype="bfloat16", cpu_kv_cache_gib=0.002)
    pools = {kv: LLM(path, kv_cache_dtype=kv, **run).engine for kv in ("auto", "fp8")}
    assert pools["auto"].pool.kv.dtype == torch.bfloat16
    bf16_pages = pools["auto"].pool.num_pages
    # the budget's floor division: a bf16 page's remainder may hold one more FP8 page
    assert pools["fp8"].pool.num_pages in (2 * bf16_pages, 2 * bf16_pages + 1)
    config = AutoConfig.from_pretrained(path)
    for kv, name in (("auto", "bf16"), ("fp8", "fp8")):
        layout = kv_layout(config, Parallel(), RUN["page_size"], KV_DTYPES[name])
        assert pools[kv].layout.bytes_per_page == layout.bytes_per_page, kv


@pytest.mark.slow  # the 135M-parameter default model on 2 cores
def test_default_model_with_fp8_pages_stays_close_to_float32_kv(default_model_llm):
    """The reference is the session's float32-KV default model (conftest's
    default_model_llm); the FP8 engine differs from it in kv_cache_dtype alone."""
    from conftest import DEFAULT_MODEL_CPU
    from prompts import QUESTIONS

    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:6]]
    judge = SamplingParams(temperature=0, max_tokens=24, logprobs=5)  # off-defaults: judge
    ref = [o.outputs[0] for o in default_model_llm.chat(convs, judge, use_tqdm=False)]
    llm = LLM(kv_cache_dtype="fp8", **DEFAULT_MODEL_CPU)
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.chat(convs, params, use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outs]
    rows = [o.outputs[0] for o in outs]
    assert any(r.finish_reason == "stop" for r in ref), "no EOS ending in the reference"
    bad = collapsed_rows(llm, prompts, rows, ref, llm.engine.eos_token_ids)
    assert not bad, f"rows {bad} collapsed against float32 KV"
