"""Tensor parallel on two GPUs (NCCL), for a machine that has them; skipped elsewhere.

TP=2 against TP=1 on a tiny Llama in float32, eager (tensor parallel captures no graphs
yet), the pool left for the memory plan to size on every rank: the same greedy tokens,
with the default endings (EOS and a stop token), and with the host tier forcing swaps.
Written for the nvidia-h200-x2 machine; not yet run there.
"""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

KW = dict(device="cuda", dtype="float32", enforce_eager=True, max_model_len=96, page_size=4)
PROMPTS = [[5 + i, 6, 7 + 2 * i, 8, 9, 10 + i] * (1 + i % 3) for i in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-gpu-llama")
    save_tiny_model(path, "LlamaForCausalLM")
    return str(path)


def _tokens(llm, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_tp2_plans_its_pool_on_both_gpus_and_equals_tp1(model_dir):
    """No num_kv_pages or kv_cache_size_gib: the memory plan runs on both ranks and the
    pool gets the fewer pages of the two. A rank's page holds half the KV heads, and the
    tiny model's KV dominates what a GPU has left, so TP=2 plans about twice TP=1's pages
    (rank 0's full-head layout would plan about as many). Greedy tokens equal TP=1's,
    stopped by a token mid-pipeline too."""
    params = SamplingParams(temperature=0, max_tokens=16)
    one = LLM(model_dir, **KW)
    want = _tokens(one, params)
    stop = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[want[0][4]])
    want_stopped = _tokens(one, stop)
    one_pages = one.engine.pool.num_pages
    del one
    llm = LLM(model_dir, tensor_parallel_size=2, **KW)
    try:
        assert llm.engine.pool.num_pages >= 1.5 * one_pages, (llm.engine.pool.num_pages, one_pages)
        assert _tokens(llm, params) == want
        assert _tokens(llm, stop) == want_stopped
    finally:
        llm.engine.shutdown()


def test_tp2_with_the_host_tier_swapping_equals_tp1(model_dir):
    """A pool too small for the batch and a host tier that swaps whatever it costs: every
    rank's copies mirror rank 0's, and the tokens stay TP=1's."""
    params = SamplingParams(temperature=0, max_tokens=24)
    want = _tokens(LLM(model_dir, **KW), params)
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        num_kv_pages=40,
        host_kv_size_gib=0.02,
        tier_policy="always",
        **KW,
    )
    try:
        assert _tokens(llm, params) == want
        assert llm.engine.metrics()["swaps_out"] > 0
        (worker,) = llm.engine.tier_worker_metrics()
        assert worker["stores"] > 0 and worker["loads"] > 0, worker
    finally:
        llm.engine.shutdown()
