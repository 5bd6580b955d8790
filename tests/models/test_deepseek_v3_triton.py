"""DeepSeek-V3 on the Triton attention backend gives the torch backend's results.

CPU fp32, the kernels (store_latent, mla_decode, prefill_attention) in Triton's
interpreter: greedy tokens identical and logprobs within 1e-4 of the torch backend,
through chunked prefill (a small token budget), prefix-cache hits (shared prefixes) and
decode steps mixed with prefill chunks. The interpreter is slow: few prompts, few tokens.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_deepseek_v3 import CONFIGS, save_tiny_deepseek  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402

RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, max_num_seqs=4)
MAX_NEW = 5


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randint(3, 500) for _ in range(22)]
    return [
        shared + [rng.randint(3, 500) for _ in range(6)],  # longer than the token budget
        [rng.randint(3, 500) for _ in range(3)],
        shared + [rng.randint(3, 500) for _ in range(2)],  # a prefix hit on the first
        [rng.randint(3, 500) for _ in range(9)],
    ]


def _run(path, backend: str, prompts):
    llm = LLM(
        model=str(path),
        attention_backend=backend,
        num_kv_pages=48,
        max_num_batched_tokens=16,
        **RUN,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(prompts[:2], params, use_tqdm=False)]
    # the second wave finds the first's full pages in the prefix cache
    outs += [o.outputs[0] for o in llm.generate(prompts[2:], params, use_tqdm=False)]
    return llm.engine, outs


@pytest.mark.parametrize("name", ["q_lora", "moe_kimi_like"])
def test_triton_backend_matches_torch_backend(tmp_path, name):
    save_tiny_deepseek(tmp_path, **CONFIGS[name])
    prompts = _prompts()
    _, expected = _run(tmp_path, "torch", prompts)
    engine, got = _run(tmp_path, "triton", prompts)
    assert engine.runner.attention_backend == "triton"
    assert engine.kv.prefix_hit_tokens > 0, "the second wave should hit the prefix cache"
    assert engine.runner.graphs is None  # the CPU runs eagerly
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.token_ids == b.token_ids, f"request {i}"
        for step, tok in enumerate(a.token_ids):
            worst = max(worst, abs(a.logprobs[step][tok].logprob - b.logprobs[step][tok].logprob))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
