"""Tensor parallel (this process rank 0, one spawned gloo worker) in the configuration
users run: no logprobs, so decode steps are queued ahead (pipelined), EOS endings (each
checkpoint's EOS is a token its runs emit mid-way), debug off, tier_policy auto. The host
tier under a pool too small for the batch (a tiny Llama: swaps and host prefix hits), MLA
(a tiny DeepSeek-V3 with experts, tier on) and KDA (a tiny Kimi Linear, tier on with
state checkpoints): greedy tokens and finish reasons equal to tensor_parallel_size=1 on an
ample pool with the tier off, on the CPU in float32."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import record_launches, save_tiny_model
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek
from kimi_checkpoints import save_tiny_kimi
from penalty_reference import set_eos

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=32, max_num_seqs=8)
PARAMS = SamplingParams(temperature=0, max_tokens=16)


def _prompts(seed: int, head: int, tails: tuple[int, int], n: int = 8) -> list[list[int]]:
    """n prompts: a shared head of `head` tokens, then a tail of its own."""
    rng = random.Random(seed)
    shared = [rng.randint(3, 500) for _ in range(head)]
    return [shared + [rng.randint(3, 500) for _ in range(rng.randint(*tails))] for _ in range(n)]


def _rows(outs) -> list[tuple[list[int], str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _reference(path: Path, prompts, max_model_len: int) -> list:
    """The TP=1, ample-pool, tier-off run, after setting the checkpoint's EOS to a token
    the first run emits mid-way in the most rows: some rows stop on it, others run to
    their length."""
    kw = dict(num_kv_pages=400, max_model_len=max_model_len, **KW)
    free = _rows(LLM(str(path), **kw).generate(prompts, PARAMS, use_tqdm=False))
    counts = Counter(t for tokens, _ in free for t in set(tokens[2:-2]) if t > 2)
    set_eos(path, counts.most_common(1)[0][0])
    want = _rows(LLM(str(path), **kw).generate(prompts, PARAMS, use_tqdm=False))
    assert {r for _, r in want} == {"stop", "length"}, want
    return want


def _tp2(path: Path, prompts, calls: int, **kw) -> tuple[list, dict, list, dict]:
    """`calls` generate() calls at tensor_parallel_size=2: their rows, rank 0's metrics,
    whether each decode launch was queued behind another, and the worker's tier counters."""
    llm = LLM(str(path), tensor_parallel_size=2, **KW, **kw)
    try:
        launches = record_launches(llm.engine.runner)
        runs = [_rows(llm.generate(prompts, PARAMS, use_tqdm=False)) for _ in range(calls)]
        m = llm.engine.metrics()
        workers = llm.engine.tier_worker_metrics() if llm.engine.tier is not None else [{}]
    finally:
        llm.engine.shutdown()
    return runs, m, [behind for _, behind in launches], workers[0]


def test_host_tier_pipelined(tmp_path):
    """18 pages for six requests of up to 8 pages: swaps; the second call finds the
    shared head's pages on host. The worker copies what rank 0 copies."""
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    prompts = _prompts(seed=0, head=8, tails=(3, 10), n=6)
    want = _reference(tmp_path, prompts, max_model_len=64)
    tier = dict(num_kv_pages=18, host_kv_size_gib=0.001, max_model_len=64)
    runs, m, behind, worker = _tp2(tmp_path, prompts, calls=2, **tier)
    assert runs == [want, want]
    assert m["tier_loads_pay"] and m["swaps_in"] > 0 and m["recomputes"] == 0, m
    assert m["host_prefix_hit_pages"] > 0, m
    assert any(behind), "no decode step was queued ahead"
    assert worker["pages_loaded"] == m["pages_loaded"] > 0, (worker, m)


@pytest.mark.slow
def test_mla_pipelined_with_the_tier(tmp_path):
    """DeepSeek-V3 with a dense first layer then experts: MLA heads split over the
    replicated latent pages, one expert block per rank; an ample pool, then a pool too
    small, whose latent pages swap on both ranks."""
    save_tiny_deepseek(tmp_path, **CONFIGS["moe_dense_first"])
    prompts = _prompts(seed=1, head=8, tails=(1, 12), n=6)
    want = _reference(tmp_path, prompts, max_model_len=64)
    runs, _, behind, _ = _tp2(tmp_path, prompts, calls=1, num_kv_pages=200, max_model_len=64)
    assert runs == [want]
    assert any(behind), "no decode step was queued ahead"
    tier = dict(num_kv_pages=18, host_kv_size_gib=0.001, max_model_len=64)
    runs, m, behind, worker = _tp2(tmp_path, prompts, calls=1, **tier)
    assert runs == [want]
    assert m["swaps_in"] > 0 and m["recomputes"] == 0, m
    assert any(behind), "no decode step was queued ahead"
    assert worker["pages_loaded"] == m["pages_loaded"] > 0, (worker, m)


@pytest.mark.slow
def test_kda_pipelined_with_state_swaps_and_checkpoints(tmp_path):
    """Kimi Linear (3 KDA : 1 MLA): each rank's state slots hold its KDA heads; a pool too
    small swaps pages and state slots, and the second call resumes the shared head from a
    state checkpoint at 16, on both ranks."""
    pytest.importorskip("transformers.models.kimi_linear")
    L, F = "linear_attention", "full_attention"
    save_tiny_kimi(tmp_path, layer_types=[L, L, L, F], first_k_dense_replace=1)
    prompts = _prompts(seed=2, head=18, tails=(1, 40), n=6)
    want = _reference(tmp_path, prompts, max_model_len=128)
    tier = dict(
        num_kv_pages=40, host_kv_size_gib=0.002, state_checkpoint_interval=16, max_model_len=128
    )
    runs, m, behind, worker = _tp2(tmp_path, prompts, calls=2, **tier)
    assert runs == [want, want]
    assert m["tier_loads_pay"] and m["recomputes"] == 0, m
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] > 0, m
    assert m["state_checkpoint_hit_tokens"] > 0, m
    assert any(behind), "no decode step was queued ahead"
    assert worker["state_loads"] > 0 and worker["state_stores"] > 0, worker
