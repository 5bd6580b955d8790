"""Attention data parallel's decode CUDA graphs on two GPUs (NCCL), for a machine that
has them; skipped elsewhere. data_parallel_size=2 with enable_expert_parallel on a tiny
DeepSeek-V3 in bfloat16: each rank captures its decode graphs (the fixed-capacity
all-to-alls inside, bucket bs's sized for bs tokens a rank) in the first round where
every rank decodes or idles, replays them in such rounds (every rank the largest rank's
bucket, an idle one padding alone) and decodes eagerly beside a prefill
(runner/paired.py); greedy tokens equal enforce_eager's. Written for the nvidia-h100-x2
machine; not yet run there (none has been lent).
"""

from __future__ import annotations

import pytest
import torch
from deepseek_checkpoints import save_tiny_deepseek

from batchgen import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

CONFIG = dict(first_k_dense_replace=0, n_shared_experts=1)


def test_dp2_expert_parallel_decode_graphs_equal_eager(tmp_path):
    save_tiny_deepseek(tmp_path, **CONFIG)
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        max_model_len=96,
        page_size=4,
        max_num_seqs=16,  # buckets 1 to 16: a short capture
        data_parallel_size=2,
        enable_expert_parallel=True,
    )
    prompts = [[5 + i, 6, 7 + 2 * i, 8, 9, 10 + i] * (1 + i % 3) for i in range(12)]
    alone = [[3, 4, 5, 6, 7, 8, 9]]  # one request: rank 1 idles beside rank 0's decode
    params = SamplingParams(temperature=0, max_tokens=16)
    fifteen = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # 15 decodes

    def tokens(llm, rows, params=params):
        outs = llm.generate(rows, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    eager = LLM(str(tmp_path), enforce_eager=True, **kw)
    try:
        want = tokens(eager, prompts), tokens(eager, alone, fifteen)
        eager_ranks = eager.engine.rank_metrics()
    finally:
        eager.engine.shutdown()
    llm = LLM(str(tmp_path), **kw)
    try:
        graphs = llm.engine.local.runner.graphs
        assert graphs is not None
        got = tokens(llm, prompts), tokens(llm, alone, fifteen)
        assert graphs.graphs, "no decode step was replayed from a CUDA graph"
        ranks = llm.engine.rank_metrics()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert [m["dp_fixed_forwards"] for m in eager_ranks] == [0, 0]  # no graphs: VARIABLE
    fixed = [m["dp_fixed_forwards"] for m in ranks]
    assert fixed[0] == fixed[1] >= 15  # the lone request's decode steps at least
    assert ranks[1]["dp_fixed_dummies"] >= 15  # rank 1's padding replays beside them
    assert ranks[0]["dp_variable_forwards"] == ranks[1]["dp_variable_forwards"]
