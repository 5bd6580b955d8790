"""FP8 KV pages on the GPU in the configuration users run (bf16, decode CUDA graphs,
pipelined decode, EOS endings, no logprobs, host tier at its default policy, debug
off): a tiny DeepSeek-V3 (FP8 latent) and a tiny Qwen3 (FP8 K/V) on a pool too small
for the batch, against the same model with bf16 KV on an ample pool asked for five
logprobs: no row may collapse under the logprob-closeness rule, endings included. The
CPU variant is test_kv_fp8.py."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model
from deepseek_checkpoints import save_tiny_deepseek
from gpu_defaults import GPU, PathSeen, collapsed_rows, grouped_prompts
from parity import completions
from penalty_reference import emitted_eos, set_eos

from batchgen import LLM, SamplingParams
from batchgen.kv_quant import FP8

pytestmark = pytest.mark.gpu

KW = dict(page_size=16, max_model_len=512, max_num_seqs=32)
DEFAULT = SamplingParams(temperature=0, max_tokens=48)
JUDGE = SamplingParams(temperature=0, max_tokens=48, logprobs=5)  # off-defaults: judge


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"kv-fp8-gpu-{request.param}")
    if request.param == "deepseek_v3":
        save_tiny_deepseek(path, first_k_dense_replace=1)
    else:
        save_tiny_model(path, "Qwen3ForCausalLM")
    prompts = grouped_prompts(seed=11)
    free = completions(LLM(str(path), num_kv_pages=1024, **GPU, **KW), prompts, JUDGE)
    set_eos(path, emitted_eos([list(c.token_ids) for c in free]))
    ref = completions(LLM(str(path), num_kv_pages=1024, **GPU, **KW), prompts, JUDGE)
    assert {c.finish_reason for c in ref} == {"stop", "length"}
    return str(path), prompts, ref


def test_fp8_pages_swap_and_stay_close_to_bf16_kv(model):
    path, prompts, ref = model
    llm = LLM(path, num_kv_pages=60, host_kv_size_gib=0.25, kv_cache_dtype="fp8", **GPU, **KW)
    assert llm.engine.pool.kv.dtype == FP8 and llm.engine.tier.host_pool.kv.dtype == FP8
    seen = PathSeen(llm)
    outs = completions(llm, prompts, DEFAULT)
    seen.check()
    m = llm.engine.metrics()
    assert m["swaps_out"] > 0 and m["readback_checks"] == 0, m
    assert {c.finish_reason for c in outs} == {"stop", "length"}
    bad = collapsed_rows(llm, prompts, outs, ref, llm.engine.eos_token_ids)
    assert not bad, f"rows {bad} collapsed against bf16 KV"
