"""The fixed-capacity expert-parallel dispatch (layers/expert_parallel.py, the decode
CUDA graphs' path) on spawned gloo ranks: equal to the variable dispatch and to the
one-process experts, with uneven tokens by rank (one rank with none, one rank's tokens
all routed to another rank's experts), and reading nothing on the host (the tensor
methods that would are patched to fail while it runs, its experts' own call aside)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from deepseek_checkpoints import tiny_config
from ep_layers import CONFIG, ep_moe, full_moe
from tp_workers import run_ranks

from batchgen.layers import moe as moe_module
from batchgen.layers.expert_parallel import ExpertParallel, dispatch_combine, fixed_capacity
from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.tp_group import TPGroup

NUM_EXPERTS = 8
HOST_READS = ("item", "tolist", "nonzero", "numpy", "__bool__", "__int__", "__float__")
TORCH_READS = ("nonzero", "bincount", "unique", "repeat_interleave")
_armed = [False]


@contextmanager
def no_host_reads():
    """Every tensor method or torch function that reads a device value on the host
    raises AssertionError inside, while `_armed` holds."""
    saved = {(torch.Tensor, n): getattr(torch.Tensor, n) for n in HOST_READS}
    saved |= {(torch, n): getattr(torch, n) for n in TORCH_READS}

    def guarded(name, original):
        def call(*args, **kwargs):
            if _armed[0]:
                raise AssertionError(f"host read in the fixed-capacity dispatch: {name}")
            return original(*args, **kwargs)

        return call

    for (owner, name), original in saved.items():
        setattr(owner, name, guarded(name, original))
    _armed[0] = True
    try:
        yield
    finally:
        _armed[0] = False
        for (owner, name), original in saved.items():
            setattr(owner, name, original)


def _inputs(counts: list[int], to_rank: int | None):
    """Every rank's tokens, routing weights and expert ids [sum(counts), 2]; to_rank:
    rank 0's pairs all go to that rank's experts."""
    g = torch.Generator().manual_seed(1)
    total = sum(counts)
    x = 0.5 * torch.randn(total, 64, generator=g)
    weights = torch.rand(total, 2, generator=g)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:2] for _ in range(total)])
    if to_rank is not None:
        per_rank = NUM_EXPERTS // len(counts)
        block = torch.randint(0, per_rank, (counts[0], 2), generator=g)
        ids[: counts[0]] = to_rank * per_rank + block
    return x, weights, ids


def _fixed_rank(tp: TPGroup, counts: list[int], to_rank: int | None) -> dict:
    """This rank's outputs: its own tokens through the variable and the fixed-capacity
    dispatch, whether the variable one read the host, and the MoE layer under
    fixed_capacity() with replicated tokens."""
    full = full_moe()
    x, weights, ids = _inputs(counts, to_rank)
    start = sum(counts[: tp.rank])
    mine = slice(start, start + counts[tp.rank])
    moe = ep_moe(full, ExpertParallel(tp))

    def experts(rows, w, expert_ids):  # the experts' own CPU path may read the host
        _armed[0] = False
        try:
            return moe.experts(rows, w, expert_ids)
        finally:
            _armed[0] = True

    args = (x[mine], weights[mine], ids[mine], experts, NUM_EXPERTS, tp)
    out = {}
    with torch.no_grad():
        out["variable"] = dispatch_combine(*args)
        with no_host_reads():
            out["fixed"] = dispatch_combine(*args, capacity=max(counts))
            try:
                dispatch_combine(*args)
                out["variable_reads_host"] = False
            except AssertionError:
                out["variable_reads_host"] = True
        # the variable call above stopped at its counts' host read, before its rows'
        # all-to-all: every rank stopped there, so the collectives still pair up
        whole = torch.cat([x, x[:3]])
        with fixed_capacity():
            out["layer"] = moe(whole)
        local = ep_moe(full, ExpertParallel(tp, local_tokens=True, max_tokens=2))
        for key, capacity in (("over_capacity", 3), ("over_bucket", 1)):
            with fixed_capacity(capacity):
                try:
                    local(whole[:2])
                    out[key] = None
                except ValueError as e:
                    out[key] = str(e)
    return out


def _check(counts: list[int], tmp_path, to_rank: int | None = None) -> None:
    full = full_moe()
    x, weights, ids = _inputs(counts, to_rank)
    with torch.no_grad():
        want = full.experts(x, weights, ids)
        want_layer = full(torch.cat([x, x[:3]]))
    results = run_ranks(_fixed_rank, len(counts), tmp_path, counts, to_rank)
    start = 0
    for rank, got in enumerate(results):
        rows = slice(start, start + counts[rank])
        start += counts[rank]
        assert got["fixed"].shape == (counts[rank], 64)
        assert torch.allclose(got["fixed"], want[rows], rtol=0, atol=1e-5)
        assert torch.allclose(got["fixed"], got["variable"], rtol=0, atol=1e-5)
        assert got["variable_reads_host"]  # the guard catches a host read
        assert torch.allclose(got["layer"], want_layer, rtol=0, atol=1e-5)
        assert "max_tokens=2" in got["over_capacity"]
        assert "2 tokens on a rank exceed the fixed capacity 1" in got["over_bucket"]


def test_fixed_capacity_two_ranks_one_empty_all_to_the_other_rank(tmp_path):
    counts = [7, 0]
    _, _, ids = _inputs(counts, to_rank=1)
    assert (ids >= NUM_EXPERTS // 2).all()  # every pair of rank 0 to rank 1's experts
    _check(counts, tmp_path, to_rank=1)


@pytest.mark.slow
def test_fixed_capacity_four_uneven_ranks(tmp_path):
    """Rank 0's pairs all to rank 2's experts; rank 1 none; rank 2 the most tokens."""
    counts = [4, 0, 9, 2]
    _, _, ids = _inputs(counts, to_rank=2)
    assert ((ids[:4] // 2) == 2).all()
    _check(counts, tmp_path, to_rank=2)


def test_graph_safe_under_expert_parallel_of_replicated_tokens_only(monkeypatch):
    """Where the experts' GEMMs are capturable, a layer expert parallel over replicated
    tokens is graph-safe (the decode graphs take the fixed-capacity dispatch); over
    local tokens (attention data parallel, decode eager) it is not."""
    monkeypatch.setattr(moe_module, "grouped_mm_serves", lambda dtype, device: True)
    tp = TPGroup(1, 2)
    for local, safe in ((False, True), (True, False)):
        layer = DeepseekV3MoE(tiny_config(**CONFIG), ep=ExpertParallel(tp, local_tokens=local))
        assert layer.graph_safe(torch.bfloat16, "cuda") is safe
