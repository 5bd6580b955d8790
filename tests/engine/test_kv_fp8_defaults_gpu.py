"""FP8 KV pages on the GPU in the configuration users run (bf16, decode CUDA graphs,
pipelined decode, EOS endings, no logprobs, host tier at its default policy, debug
off): a tiny DeepSeek-V3 (FP8 latent) and a tiny Qwen3 (FP8 K/V) on a pool too small
for the batch, against the same model with FP8 KV on an ample pool asked for five
logprobs: the same storage precision (prefill and decode both read K/V from the pages),
only the batching and the trips through the host tier differ, so no row may collapse
under the logprob-closeness rule, endings included, as the bf16 tier matrix demands.
DeepSeek-V3 is dense here (MLA and an MLP in each layer): a bf16 router flips expert choices on
the batch changes a small pool makes alone (test_kimi_linear_tier_defaults_gpu.py's
reason; MoE under pressure is test_deepseek_v3_defaults_gpu.py's, judged relatively).

Closeness to bf16 KV is a question of FP8's precision, not of the tier: on a random
tiny model, whose top five logits lie within ~0.2 nats, e4m3's rounding of the latent
(~2.5% RMS an element) flips ranks beyond the top five at some divergences, more where
it flips an expert choice (4 rows of 32 for a MoE DeepSeek-V3 on an H100). benchmarks/precision.py --model w1 reports it (FP8 KV's
probe against bf16 KV's, collapsed rows and largest logprob difference) on a model of
real shape. The CPU variant is test_kv_fp8.py (FP8 against float32 KV)."""

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
        save_tiny_deepseek(path)  # every layer dense (see the module docstring)
    else:
        save_tiny_model(path, "Qwen3ForCausalLM")
    prompts = grouped_prompts(seed=11)
    ample = dict(num_kv_pages=1024, kv_cache_dtype="fp8", **GPU, **KW)
    free = completions(LLM(str(path), **ample), prompts, JUDGE)
    set_eos(path, emitted_eos([list(c.token_ids) for c in free]))
    ref_llm = LLM(str(path), **ample)
    assert ref_llm.engine.pool.kv.dtype == FP8
    ref = completions(ref_llm, prompts, JUDGE)
    assert {c.finish_reason for c in ref} == {"stop", "length"}
    return str(path), prompts, ref


def test_fp8_pages_swap_and_stay_close_to_an_ample_fp8_pool(model):
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
    assert not bad, f"rows {bad} collapsed against FP8 KV on an ample pool"
