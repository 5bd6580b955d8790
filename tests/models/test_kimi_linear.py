"""Kimi Linear (KDA + NoPE MLA + MoE) against transformers on tiny random checkpoints,
CPU fp32: greedy tokens identical in the engine's default configuration (pipelined
decode, EOS endings), and logprobs within 1e-4 in runs that ask for them (which turns
pipelined decode off).

Prompts cross the KDA chunk size (64), prefills are chunked across steps (a small token
budget), batches mix lengths, and a small pool preempts (without the host tier hybrid
requests recompute, their state rebuilt from token 0; test_kimi_linear_swap.py swaps
them with it).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import record_queued
from kimi_checkpoints import (  # noqa: F401 (tiny_config re-exported)
    save_tiny_kimi,
    tiny_config,
    transformers_torch_kda,
)
from test_deepseek_v3 import MAX_NEW, Reference

from batchgen import LLM, SamplingParams
from batchgen.models.loader import ModelSource, build_model

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=256, max_num_seqs=8)
F, L = "full_attention", "linear_attention"
PATTERNS = {
    # Kimi Linear's shape: 3 KDA : 1 MLA, a dense first MLP then experts, plain q
    "kda3_mla1": {"layer_types": [L, L, L, F], "first_k_dense_replace": 1},
    # MLA first and last, q through its LoRA, two dense MLPs, two shared experts
    "mla_kda_kda_mla": {
        "layer_types": [F, L, L, F],
        "first_k_dense_replace": 2,
        "q_lora_rank": 48,
        "n_shared_experts": 2,
    },
    # no group limit, all MLPs sparse
    "mla_kda": {
        "layer_types": [F, L],
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
    },
}


@pytest.fixture(scope="module", autouse=True)
def transformers_torch_path():
    """transformers binds fla-core's kernels in place of its torch KDA where fla-core is
    installed; the reference is its torch code, on the CPU."""
    with transformers_torch_kda():
        yield


def _prompts(n: int = 10) -> list[list[int]]:
    """Mixed lengths, several past one KDA chunk (64) and one past two."""
    rng = random.Random(0)
    lengths = [3, 70, 17, 140, 1, 66, 40, 9, 100, 25][:n]
    return [[rng.randint(3, 500) for _ in range(k)] for k in lengths]


def _checkpoint(path, pattern: dict) -> tuple[str, list[list[int]], Reference]:
    model = save_tiny_kimi(path, **pattern)
    prompts = _prompts()
    return str(path), prompts, Reference(model, path, prompts)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    """The first pattern's checkpoint and reference, shared by the tests that need one."""
    path = tmp_path_factory.mktemp("kimi-linear")
    return _checkpoint(path, PATTERNS["kda3_mla1"])


@pytest.mark.parametrize("name", PATTERNS)
def test_greedy_and_logprobs_match_transformers(tmp_path, kimi_linear, name):
    path, prompts, ref = (
        kimi_linear if name == "kda3_mla1" else _checkpoint(tmp_path, PATTERNS[name])
    )
    llm = LLM(model=path, num_kv_pages=400, max_num_batched_tokens=48, **RUN)
    queued = record_queued(llm.engine.runner)
    engine = llm.engine
    config = engine.model.config
    assert engine.layout.num_layers == config.layer_types.count(F)
    assert engine.state_pool.layout.num_layers == config.layer_types.count(L)
    assert engine.state_pool.num_slots == RUN["max_num_seqs"] + 1

    # the default configuration: pipelined decode, EOS endings; chunked prefill
    ref.check(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW)))
    assert any(queued), "no decode step was queued ahead"
    assert max(len(p) for p in prompts) > 2 * 48, "a prompt should span several steps"
    assert engine.scheduler.num_preemptions == 0
    assert engine.kv.prefix_hit_tokens == 0  # hybrid models cache no prefixes yet

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    worst = ref.check(llm.generate(prompts, params, use_tqdm=False), logprobs=True)
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_one_step_prefill_matches_transformers(kimi_linear):
    """Whole prompts in one step (a budget above the longest): every request of the
    batch prefills together, packed, across KDA chunk boundaries."""
    path, prompts, ref = kimi_linear
    llm = LLM(model=path, num_kv_pages=400, max_num_batched_tokens=1024, **RUN)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    worst = ref.check(llm.generate(prompts, params, use_tqdm=False), logprobs=True)
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_preemption_recomputes_from_token_zero(kimi_linear):
    """A pool too small for the batch preempts running requests; with the host tier off a
    hybrid request is recomputed (its state slot released, rebuilt from token 0), and
    the outputs equal transformers' (and so the ample-pool run's)."""
    path, prompts, ref = kimi_linear
    small = {**RUN, "max_model_len": 160}  # 40 pages of 4: the longest request fits alone
    llm = LLM(model=path, num_kv_pages=40, max_num_batched_tokens=48, **small)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    worst = ref.check(llm.generate(prompts, params, use_tqdm=False), logprobs=True)
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
    m = llm.engine.metrics()
    assert m["preemptions"] > 0 and m["recomputes"] == m["preemptions"], m
    assert llm.engine.scheduler.state_slots.num_free == RUN["max_num_seqs"]


def test_shared_prefix_is_recomputed_not_hit(tmp_path):
    """Prefix caching is off for hybrid models (no state checkpoints yet): a request whose
    prefix an earlier one computed computes it again, with transformers' outputs."""
    model = save_tiny_kimi(tmp_path, seed=1, **PATTERNS["mla_kda"])
    rng = random.Random(4)
    shared = [rng.randint(3, 500) for _ in range(45)]
    prompts = [shared + [7, 8, 9], shared + [rng.randint(3, 500) for _ in range(5)]]
    ref = Reference(model, tmp_path, prompts)
    llm = LLM(model=str(tmp_path), num_kv_pages=64, max_num_batched_tokens=64, **RUN)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert llm.engine.kv.prefix_hit_tokens == 0
    assert llm.engine.metrics()["prefill_tokens_computed"] == sum(len(p) for p in prompts)
    for i, out in enumerate(outs):
        tokens, reason = ref.expected(i)
        assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == reason
        for step, tok in enumerate(tokens):
            got = out.outputs[0].logprobs[step][tok].logprob
            assert abs(got - ref.runs[i][1][step][tok].item()) < 1e-4


def test_checkpoint_names(tmp_path):
    """KDA, NoPE MLA, dense and MoE names map to their parameters; A_log and dt_bias
    stay float32 under bfloat16; every parameter is filled by save_pretrained's names."""
    save_tiny_kimi(tmp_path, **PATTERNS["kda3_mla1"])
    source = ModelSource.resolve(tmp_path)
    config = source.load_config()
    model = build_model(source, config, torch.float32, torch.device("cpu"), 64)
    assert model.rotary is None and model.num_kv_layers == 1
    kda, mla = model.layers[0].self_attn, model.layers[3].self_attn
    assert mla.layer_id == 0  # its KV layer, not its decoder index
    assert model.checkpoint_target("model.layers.0.self_attn.forget_gate.A_log") == (
        kda,
        "A_log",
        None,
    )
    assert model.checkpoint_target("model.layers.1.self_attn.k_proj.weight") == (
        model.layers[1].self_attn.in_proj,
        "weight",
        "k",
    )
    assert model.checkpoint_target("model.layers.1.self_attn.g_a_proj.weight") == (
        model.layers[1].self_attn.in_proj,
        "weight",
        "g_a",
    )
    assert model.checkpoint_target("model.layers.3.self_attn.kv_b_proj.weight") == (
        mla.kv_b_proj,
        "weight",
        None,
    )
    assert model.checkpoint_target("model.layers.0.mlp.up_proj.weight") == (
        model.layers[0].mlp.gate_up_proj,
        "weight",
        "up",
    )
    experts = model.layers[2].mlp.experts
    assert model.checkpoint_target("model.layers.2.mlp.experts.gate_up_proj") == (
        experts,
        "gate_up_proj",
        None,
    )
    bf16 = build_model(source, config, torch.bfloat16, torch.device("cpu"), 64, "dummy")
    assert bf16.layers[0].self_attn.A_log.dtype == torch.float32
    assert bf16.layers[0].self_attn.dt_bias.dtype == torch.float32
    assert bf16.layers[0].self_attn.in_proj.weight.dtype == torch.bfloat16
