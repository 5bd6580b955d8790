"""deterministic=True on the Triton attention backend (kernels/invariant_attention.py):
each prompt's tokens and logprobs are the same bits alone, in a batch of mixed lengths,
batched another way (two rows a step, the prompts reversed), prefilled in chunks of 16
tokens and after prefix-cache hits. A tiny Llama (GQA) and a tiny DeepSeek-V3 (MLA:
decode and prefill rows absorbed through one kernel). The kernels run in Triton's
interpreter on the CPU, so the model and the runs are small."""

from __future__ import annotations

import random

import pytest
from conftest import save_random_model, save_tiny_model
from deepseek_checkpoints import tiny_config as deepseek_config

from batchgen import LLM, SamplingParams

KW = dict(
    device="cpu",
    dtype="float32",
    attention_backend="triton",
    deterministic=True,
    max_model_len=128,
    page_size=4,
    num_kv_pages=160,
)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randint(3, 400) for _ in range(12)]
    prompts = [[rng.randint(3, 400) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    return [shared + p if i % 3 == 0 else p for i, p in enumerate(prompts)]


def _rows(llm: LLM, prompts, order) -> dict[int, tuple]:
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=0, ignore_eos=True)
    outs = llm.generate([prompts[i] for i in order], params, use_tqdm=False)
    rows = {}
    for i, out in zip(order, outs):
        c = out.outputs[0]
        rows[i] = (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return rows


def _differing(model: str, graphs: bool = False, **overrides) -> dict[str, list[int]]:
    """Per run, the prompts whose row differs from the prompt run alone. graphs: every
    engine must have replayed decode CUDA graphs."""
    kw = dict(KW, **overrides)
    prompts = _prompts()
    order = list(range(len(prompts)))
    alone_llm = LLM(model=model, **kw)
    assert alone_llm.engine.runner.attention_backend == "triton"
    alone = {}
    for i in order:
        alone.update(_rows(alone_llm, prompts, [i]))
    batched = LLM(model=model, **kw)
    runs = {"batch": _rows(batched, prompts, order)}
    runs["prefix hits"] = _rows(batched, prompts, order)
    assert batched.engine.metrics()["prefix_hit_tokens"] > 0
    two = LLM(model=model, **dict(kw, max_num_seqs=2))
    runs["two a step, reversed"] = _rows(two, prompts, order[::-1])
    chunked = LLM(model=model, **dict(kw, max_num_batched_tokens=16))
    runs["chunked 16"] = _rows(chunked, prompts, order)
    if graphs:
        for llm in (alone_llm, batched, two, chunked):
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    return {k: [i for i in order if v[i] != alone[i]] for k, v in runs.items()}


@pytest.mark.slow
def test_llama_rows_are_batch_invariant_on_the_triton_kernels(tmp_path):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    differ = _differing(str(tmp_path))
    assert differ == {k: [] for k in differ}


@pytest.mark.slow
def test_mla_rows_are_batch_invariant_on_the_triton_kernels(tmp_path):
    save_random_model(tmp_path, deepseek_config())
    differ = _differing(str(tmp_path))
    assert differ == {k: [] for k in differ}


@pytest.mark.gpu
def test_on_cuda_decode_graphs_stay_on_and_rows_are_batch_invariant(tmp_path):
    """bf16 on a GPU, the backend left to "auto" (Triton there): decode replays CUDA graphs
    (padding rows in most buckets) and the rows are the same bits batched any way."""
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    cuda = dict(device="cuda", dtype="bfloat16", attention_backend="auto")
    differ = _differing(str(tmp_path), graphs=True, **cuda)
    assert differ == {k: [] for k in differ}
