"""Parity with transformers on tiny random configs of every architecture (CPU, fp32).

The run is shaped to exercise chunked prefill (small token budget), prefix-cache hits
(prompts share a long prefix) and preemption (a pool too small for the whole batch).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ARCHS, save_tiny_model
from parity import reference_greedy

from batchgen import LLM, SamplingParams

MAX_NEW = 10


def _prompts(n: int = 18) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randint(3, 500) for _ in range(24)]
    prompts = []
    for i in range(n):
        tail = [rng.randint(3, 500) for _ in range(rng.randint(1, 40))]
        prompts.append(shared + tail if i % 3 == 0 else tail + shared[: i % 7])
    return prompts


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(tmp_path, arch):
    ref = save_tiny_model(tmp_path, arch)
    llm = LLM(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        page_size=4,
        num_kv_pages=48,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
    )
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)

    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the run should have preempted"
    assert engine.kv.prefix_hit_tokens > 0, "the run should have hit the prefix cache"
    assert max(len(p) for p in prompts) > 32, "a prompt should need chunked prefill"

    worst = 0.0
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ref_tokens, ref_lps = reference_greedy(ref, prompt, MAX_NEW, eos=None)
        assert completion.token_ids == ref_tokens, f"prompt {prompt[:5]}..."
        assert completion.finish_reason == "length"
        for step, tok in enumerate(completion.token_ids):
            ours = completion.logprobs[step][tok].logprob
            worst = max(worst, abs(ours - ref_lps[step][tok].item()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_batch_invariance(tmp_path, arch):
    """A greedy request's output and a seeded sampled request's output do not depend on
    the rest of the batch."""
    save_tiny_model(tmp_path, arch)
    llm = LLM(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        page_size=4,
        num_kv_pages=256,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    target = list(range(10, 40))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone_g = llm.generate([target], greedy, use_tqdm=False)[0].outputs[0].token_ids
    alone_s = llm.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids

    rng = random.Random(5)
    others = [[rng.randint(3, 500) for _ in range(rng.randint(3, 60))] for _ in range(9)]
    noisy = SamplingParams(temperature=0.8, max_tokens=15, ignore_eos=True)
    batch = others[:4] + [target, target] + others[4:]
    params = [noisy] * 4 + [greedy, seeded] + [noisy] * 5
    outs = llm.generate(batch, params, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone_g
    assert outs[5].outputs[0].token_ids == alone_s
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone_s


def test_sampled_outputs_differ_without_seed(tmp_path):
    torch.manual_seed(0)
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(model=str(tmp_path), device="cpu", num_kv_pages=64, max_model_len=128)
    p = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = llm.generate([[5, 6, 7]] * 4, p, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1
