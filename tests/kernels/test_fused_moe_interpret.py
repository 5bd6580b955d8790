"""layers.routed_experts.fused_experts through kernels/fused_moe.py (triton_moe) against
its reference path (one matmul per expert over the same sorted pairs), on small random
routings.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it); with
CUDA the same cases run compiled. float32 runs at IEEE precision on both, so the outputs
agree to float32 rounding of another summation order."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.fused_moe import TUNING, MoETuning, align_pairs, sort_by_group
from batchgen.layers.routed_experts import fused_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = MoETuning(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


def routing(t: int, k: int, num_experts: int, gen: torch.Generator, hot: int | None = None):
    """[T, k] distinct experts per token and their weights; with `hot`, every token's
    slot j goes to expert hot + j (one expert gets all T tokens' pairs of a slot)."""
    if hot is not None:
        ids = torch.tensor([(hot + j) % num_experts for j in range(k)]).expand(t, k).clone()
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    return ids.to(DEVICE), weights.to(DEVICE)


def experts(num_experts: int, hidden: int, inter: int, gen: torch.Generator):
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up.to(DEVICE), down.to(DEVICE)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_pairs_groups_every_pair_once_in_blocks_of_one_expert(block_m):
    gen = torch.Generator().manual_seed(0)
    num_experts, pairs = 6, 23
    experts_of = torch.randint(0, num_experts + 1, (pairs,), generator=gen).to(DEVICE)
    sorted_ids, block_expert, num_blocks = align_pairs(experts_of, num_experts, block_m)
    used = int(num_blocks.item()) * block_m
    assert sorted_ids.numel() % block_m == 0 and used <= sorted_ids.numel()
    ids = sorted_ids[:used].view(-1, block_m).cpu()
    owner = block_expert[: ids.shape[0]].cpu()
    seen = []
    for block, expert in zip(ids, owner.tolist()):
        real = block[block < pairs]
        assert all(int(experts_of[p]) == expert for p in real)  # one expert a block
        seen += real.tolist()
    mine = [p for p in range(pairs) if int(experts_of[p]) < num_experts]
    assert sorted(seen) == mine  # each of this rank's pairs exactly once, no other
    assert bool((sorted_ids[used:] == pairs).all())  # the rest is padding


@pytest.mark.parametrize(
    ("t", "k", "num_experts", "hidden", "inter"),
    [(1, 2, 4, 32, 24), (7, 3, 8, 48, 40), (33, 2, 5, 16, 20)],
)
def test_matches_the_reference_path(t, k, num_experts, hidden, inter):
    gen = torch.Generator().manual_seed(t)
    gate_up, down = experts(num_experts, hidden, inter, gen)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE)
    ids, weights = routing(t, k, num_experts, gen)
    ref = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    out = fused_experts(x, gate_up, down, weights, ids, triton_moe=SMALL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launch", [(16, 64, 128, 4, 4), (16, 128, 256, 8, 3), (32, 64, 128, 4, 4)])
def test_deep_k_tiles_past_the_rows_are_masked(launch):
    """bench_kernels.py --moe's deeper launches: K tiles wider than hidden (48) and than
    inter (40), so every load of both GEMMs runs past K and must be masked."""
    gen = torch.Generator().manual_seed(5)
    gate_up, down = experts(8, 48, 40, gen)
    x = torch.randn(7, 48, generator=gen).to(DEVICE)
    ids, weights = routing(7, 3, 8, gen)
    ref = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    out = fused_experts(x, gate_up, down, weights, ids, triton_moe=MoETuning(*launch))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_one_expert_taking_every_pair_spans_many_blocks():
    gen = torch.Generator().manual_seed(1)
    gate_up, down = experts(4, 32, 24, gen)
    x = torch.randn(19, 32, generator=gen).to(DEVICE)
    ids, weights = routing(19, 2, 4, gen, hot=2)
    ref = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    out = fused_experts(x, gate_up, down, weights, ids, triton_moe=SMALL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_expert_parallel_block_adds_only_its_experts():
    gen = torch.Generator().manual_seed(2)
    num_experts, local = 8, range(4, 8)  # this rank holds experts 4..7
    gate_up, down = experts(num_experts, 32, 24, gen)
    x = torch.randn(9, 32, generator=gen).to(DEVICE)
    ids, weights = routing(9, 3, num_experts, gen)
    block = (gate_up[local.start : local.stop], down[local.start : local.stop])
    ref = fused_experts(x, *block, weights, ids, use_grouped_mm=False, first_expert=4)
    out = fused_experts(x, *block, weights, ids, first_expert=4, triton_moe=SMALL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_the_default_launch_in_bfloat16_is_within_its_rounding():
    gen = torch.Generator().manual_seed(3)
    gate_up, down = experts(8, 128, 96, gen)
    x = torch.randn(5, 128, generator=gen).to(DEVICE)
    ids, weights = routing(5, 2, 8, gen)
    ref = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    bf = [t.to(torch.bfloat16) for t in (x, gate_up, down)]
    out = fused_experts(bf[0], bf[1], bf[2], weights, ids, triton_moe=TUNING)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("num_groups", [2, 65, 256, 257, 300, 40000])
def test_sort_by_group_is_the_stable_int64_sort(num_groups):
    """Narrowed keys (uint8, int16, int32 by the group count) give exactly the permutation
    and sorted ids of torch's stable sort of the int64 ids: ties in pair order."""
    gen = torch.Generator().manual_seed(num_groups)
    groups = torch.randint(0, num_groups, (3000,), generator=gen)
    groups[:40] = num_groups - 1  # the largest id, past a uint8's or int16's sign bit
    want_sorted, want_order = torch.sort(groups, stable=True)
    got_sorted, got_order = sort_by_group(groups, num_groups)
    narrow = (
        torch.uint8 if num_groups <= 256 else torch.int16 if num_groups <= 2**15 else torch.int32
    )
    assert got_sorted.dtype == narrow
    assert torch.equal(got_order, want_order)
    assert torch.equal(got_sorted.long(), want_sorted)
