"""Kimi Linear's state tier on the GPU in the configuration users run: bf16, decode CUDA
graphs binding the KDA state slots, pipelined decode, EOS and stop-string endings, no
logprobs, debug off, tier_policy left at "auto". A pool too small for the batch swaps
pages and state slots between graph replays while state checkpoints serve prefix hits
(prompts in groups sharing 100 tokens), on two calls of one engine. Against the same
prompts on an ample pool with the tier off, asked for five logprobs (not pipelined, no
preemption, no prefix hits), no row may collapse under the logprob-closeness rule,
endings included. The dense model: a bf16 router would flip expert choices on the batch
changes a small pool makes alone (test_kimi_linear_gpu.py). The CPU variant, exact in
float32, is test_kimi_linear_tier_defaults.py."""

from __future__ import annotations

import pytest
from gpu_defaults import GPU, PathSeen, collapsed_rows, grouped_prompts
from kimi_checkpoints import save_tiny_kimi
from parity import completions
from penalty_reference import emitted_eos, set_eos

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

L, F = "linear_attention", "full_attention"
KW = dict(page_size=16, max_model_len=512, max_num_seqs=32)
# the KDA heads of tests/layers/test_kda_gpu.py, whose kernels that file tunes
LINEAR = dict(linear_num_heads=4, linear_head_dim=128)
STOP = ["w7"]  # the test tokenizer's words w7 and w70-w79
DEFAULT = SamplingParams(temperature=0, max_tokens=48, stop=STOP)
JUDGE = SamplingParams(temperature=0, max_tokens=48, stop=STOP, logprobs=5)  # off-defaults: judge


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The dense checkpoint, its EOS set to a token the ample run emits mid-way in the
    most rows, the prompts and the ample, tier-off run with logprobs under that EOS."""
    path = tmp_path_factory.mktemp("kimi-tier-defaults-gpu")
    save_tiny_kimi(path, layer_types=[L, L, L, F], first_k_dense_replace=4, **LINEAR)
    prompts = grouped_prompts(seed=7)
    free = completions(LLM(str(path), num_kv_pages=1024, **GPU, **KW), prompts, JUDGE)
    set_eos(path, emitted_eos([list(c.token_ids) for c in free]))
    ample = LLM(str(path), num_kv_pages=1024, **GPU, **KW)
    ref = completions(ample, prompts, JUDGE)
    assert ample.engine.tier is None and ample.engine.metrics()["preemptions"] == 0
    assert {c.finish_reason for c in ref} == {"stop", "length"}
    assert any(c.stop_reason in STOP for c in ref), "no stop-string ending"
    return str(path), prompts, ref


def test_swaps_and_checkpoint_hits_with_the_default_policy(model):
    path, prompts, ref = model
    llm = LLM(
        path,
        num_kv_pages=60,
        host_kv_size_gib=0.25,
        state_checkpoint_interval=32,
        **GPU,
        **KW,
    )
    assert llm.config.tier_policy == "auto" and not llm.config.batchgen_debug
    seen = PathSeen(llm)
    runs = [completions(llm, prompts, DEFAULT) for _ in range(2)]
    seen.check()
    m = llm.engine.metrics()
    assert m["tier_loads_pay"], m  # the cost rule chose loading over recomputing
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] > 0, m
    assert m["state_checkpoint_hit_tokens"] >= 2 * 4 * 3 * 96, m
    assert m["readback_checks"] == 0, m
    eos = llm.engine.eos_token_ids
    for call, outs in enumerate(runs):
        assert {c.finish_reason for c in outs} == {"stop", "length"}
        bad = collapsed_rows(llm, prompts, outs, ref, eos)
        assert not bad, f"call {call}: rows {bad} collapsed"
