"""Expert parallel (layers/expert_parallel.py) on spawned gloo ranks against the
single-process MoE layer: each rank holds its block of the experts, its tokens go to
their experts' ranks and back by all-to-all, with a different number of tokens on each
rank, one rank with none; and each rank reading only its own experts' checkpoint
tensors."""

from __future__ import annotations

import re

import pytest
import torch
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek
from ep_layers import ep_moe, full_moe
from int4_blocks import KIMI_K2_THINKING_IGNORE, write_pack_quantized
from safetensors.torch import load_file
from tp_workers import run_ranks

from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.tp_group import TPGroup
from batchgen.models.loader import ModelSource, build_model


def _tokens(total: int) -> torch.Tensor:
    return 0.5 * torch.randn(total, 64, generator=torch.Generator().manual_seed(1))


def _rows(counts: list[int], rank: int) -> slice:
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def _ep_rank(tp: TPGroup, counts: list[int]) -> dict:
    """This rank's outputs through the expert-parallel layer: its own rows of the tokens
    (local tokens), and all of them (replicated tokens, each rank a slice)."""
    full = full_moe()
    x = _tokens(sum(counts))
    out = {}
    for local in (True, False):
        moe = ep_moe(full, ExpertParallel(tp, local_tokens=local))
        with torch.no_grad():
            out[local] = moe(x[_rows(counts, tp.rank)] if local else x)
    out["experts"] = list(moe.experts.local_experts)
    out["graph_safe"] = moe.graph_safe(torch.bfloat16, "cpu")
    return out


def _check(counts: list[int], tmp_path) -> None:
    size = len(counts)
    full = full_moe()
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


def test_a_rank_reads_only_its_own_experts_tensors(tmp_path, monkeypatch):
    """Rank 1 of 2 under expert parallel reads the per-expert tensors of experts 4..7
    from the checkpoint and never those of experts 0..3; its block holds them."""
    save_tiny_deepseek(tmp_path, **CONFIGS["moe_dense_first"])
    read = []
    weights = ModelSource.weights

    def recorded(self, config, *args):
        for name, tensor in weights(self, config, *args):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(ModelSource, "weights", recorded)
    source = ModelSource.resolve(tmp_path)
    config = source.load_config()
    tp = TPGroup(1, 2)
    model = build_model(
        source, config, torch.float32, torch.device("cpu"), 64, tp=tp, ep=ExpertParallel(tp)
    )
    experts = {int(m[1]) for n in read if (m := re.search(r"\.experts\.(\d+)\.", n))}
    assert experts == {4, 5, 6, 7}
    assert any("shared_experts" in n for n in read)
    moe = model.layers[1].mlp
    assert moe.ep is not None and moe.experts.local_experts == range(4, 8)
    checkpoint = load_file(str(tmp_path / "model.safetensors"))
    down = checkpoint["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert torch.equal(moe.experts.down_proj[1], down)


def test_int4_experts_load_by_rank_under_expert_parallel(tmp_path):
    """A pack-quantized INT4 checkpoint (Kimi-K2-Thinking's split: routed experts INT4):
    rank 1 of 2 holds experts 4..7 still packed, equal to the one-process model's."""
    int4, plain = tmp_path / "int4", tmp_path / "plain"
    for d in (int4, plain):
        d.mkdir()
        save_tiny_deepseek(d, first_k_dense_replace=1, n_shared_experts=1)
    write_pack_quantized(int4, plain, lambda n: ".mlp.experts." in n, 32, KIMI_K2_THINKING_IGNORE)
    source = ModelSource.resolve(int4)
    config = source.load_config()
    cpu = torch.device("cpu")
    whole = build_model(source, config, torch.float32, cpu, 64).layers[1].mlp.experts
    tp = TPGroup(1, 2)
    share = build_model(source, config, torch.float32, cpu, 64, tp=tp, ep=ExpertParallel(tp))
    experts = share.layers[1].mlp.experts
    assert experts.group_size == 32 and experts.local_experts == range(4, 8)
    params = dict(experts.named_parameters())
    assert any(name.endswith("_packed") for name in params)
    for name, p in params.items():
        assert torch.equal(p, dict(whole.named_parameters())[name][4:8]), name
