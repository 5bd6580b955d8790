"""deterministic=True on the GPU for Kimi Linear (bf16, KDA through fla-core's kernels
with their configs pinned, decode CUDA graphs, every other default on): each prompt's
tokens and logprobs are the same bits alone, in a batch of mixed lengths, batched
another way (four rows a step, the prompts reversed), prefilled in pieces of 64 tokens,
and resumed from the KDA state checkpoints of an earlier run (prefix hits). Prompt
lengths of 64k + 1 among them: their last token steps alone after a cut."""

from __future__ import annotations

import random

import pytest
import torch
from kimi_checkpoints import save_tiny_kimi

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

L, F = "linear_attention", "full_attention"
KW = dict(
    device="cuda", dtype="bfloat16", deterministic=True, page_size=16, max_model_len=512,
    num_kv_pages=512,  # sized, not a share of free memory: the runs before still hold theirs
)  # fmt: skip
LINEAR = dict(linear_num_heads=4, linear_head_dim=128)  # tests/layers/test_kda_gpu.py's heads
LENGTHS = [1, 2, 37, 64, 65, 129, 130, 200, 257, 90, 65, 150]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-det-gpu")
    save_tiny_kimi(path, layer_types=[L, F, L, F], **LINEAR)
    return str(path)


def _prompts() -> list[list[int]]:
    """LENGTHS, every third prompt starting with the same 128 tokens (checkpoint hits)."""
    rng = random.Random(11)
    shared = [rng.randint(3, 500) for _ in range(128)]
    prompts = [[rng.randint(3, 500) for _ in range(n)] for n in LENGTHS]
    return [(shared + p)[: max(n, 129)] if i % 3 == 2 else p for i, (p, n) in
            enumerate(zip(prompts, LENGTHS))]  # fmt: skip


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, logprobs=0)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, logprobs=0)
        for i in range(len(LENGTHS))
    ]


def _rows(llm, prompts, params, order) -> dict[int, tuple]:
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    rows = {}
    for i, out in zip(order, outs):
        c = out.outputs[0]
        rows[i] = (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return rows


def test_kimi_linear_rows_are_batch_invariant_on_the_gpu(model_dir):
    prompts, params = _prompts(), _params()
    order = list(range(len(prompts)))
    alone_llm = LLM(model=model_dir, **KW)
    alone = {}
    for i in order:
        alone.update(_rows(alone_llm, prompts, params, [i]))
    checkpoints = dict(
        host_kv_size_gib=0.25, state_checkpoint_interval=64, state_checkpoint_policy="all"
    )
    batched = LLM(model=model_dir, **checkpoints, **KW)
    runs = {"batch": _rows(batched, prompts, params, order)}
    before = batched.engine.metrics()["state_checkpoint_hit_tokens"]
    runs["resumed from checkpoints"] = _rows(batched, prompts, params, order)
    assert batched.engine.metrics()["state_checkpoint_hit_tokens"] - before >= 64 * 8
    four = LLM(model=model_dir, max_num_seqs=4, **KW)
    runs["four a step, reversed"] = _rows(four, prompts, params, order[::-1])
    chunked = LLM(model=model_dir, max_num_batched_tokens=64, **KW)
    runs["chunked 64"] = _rows(chunked, prompts, params, order)
    for llm in (alone_llm, batched, four, chunked):
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    differ = {k: [i for i in order if v[i] != alone[i]] for k, v in runs.items()}
    assert differ == {k: [] for k in runs}
