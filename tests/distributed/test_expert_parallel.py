"""Expert parallel (layers/expert_parallel.py) on spawned gloo ranks against the
single-process MoE layer: each rank holds its block of the experts, its tokens go to
their experts' ranks and back by all-to-all, with a different number of tokens on each
rank, one rank with none."""

from __future__ import annotations

import pytest
import torch
from deepseek_checkpoints import tiny_config
from tp_workers import run_ranks

from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.tp_group import TPGroup

CONFIG = dict(first_k_dense_replace=0, n_shared_experts=1)


def _full_moe() -> DeepseekV3MoE:
    torch.manual_seed(0)
    moe = DeepseekV3MoE(tiny_config(**CONFIG))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _tokens(total: int) -> torch.Tensor:
    return 0.5 * torch.randn(total, 64, generator=torch.Generator().manual_seed(1))


def _rows(counts: list[int], rank: int) -> slice:
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def _ep_rank(tp: TPGroup, counts: list[int]) -> dict:
    """This rank's outputs through the expert-parallel layer: its own rows of the tokens
    (local tokens), and all of them (replicated tokens, each rank a slice)."""
    full = _full_moe()
    x = _tokens(sum(counts))
    out = {}
    for local in (True, False):
        moe = DeepseekV3MoE(tiny_config(**CONFIG), ep=ExpertParallel(tp, local_tokens=local))
        moe.load_state_dict(
            {
                **full.state_dict(),
                "experts.gate_up_proj": full.experts.gate_up_proj[moe.experts.local_experts],
                "experts.down_proj": full.experts.down_proj[moe.experts.local_experts],
            }
        )
        with torch.no_grad():
            out[local] = moe(x[_rows(counts, tp.rank)] if local else x)
    out["experts"] = list(moe.experts.local_experts)
    out["graph_safe"] = moe.graph_safe(torch.bfloat16, "cpu")
    return out


def _check(counts: list[int], tmp_path) -> None:
    size = len(counts)
    full = _full_moe()
    x = _tokens(sum(counts))
    with torch.no_grad():
        want = full(x)
        _, ids = full.gate(x)
    results = run_ranks(_ep_rank, size, tmp_path, counts)
    per_rank = 8 // size
    for rank, got in enumerate(results):
        assert got["experts"] == list(range(rank * per_rank, (rank + 1) * per_rank))
        assert not got["graph_safe"]
        rows = _rows(counts, rank)
        assert got[True].shape == (counts[rank], 64)
        # tokens routed to other ranks' experts came back with those experts' outputs
        if counts[rank]:
            assert ((ids[rows] // per_rank) != rank).any()
        assert torch.allclose(got[True], want[rows], rtol=0, atol=1e-5)
        assert torch.allclose(got[False], want, rtol=0, atol=1e-5)


def test_two_ranks_uneven_tokens_one_rank_empty(tmp_path):
    _check([11, 0], tmp_path)


@pytest.mark.slow
def test_four_ranks_uneven_tokens(tmp_path):
    _check([5, 0, 9, 3], tmp_path)
