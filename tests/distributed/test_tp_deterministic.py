"""deterministic=True under tensor parallel (gloo ranks on the CPU): every all-reduce adds
the ranks' parts in rank order, whatever order the collective library would pick, and
an engine of 2 ranks gives each prompt the same tokens and logprobs alone, in a batch of
mixed lengths and prefilled in chunks of 64 tokens (pipelined decode, prefix caching and
every other option at its default), in float32 and bfloat16; without the mode the
same runs differ."""

from __future__ import annotations

import pytest
import torch
from deterministic_cases import mixed_params, mixed_prompts, probe_rows
from tp_workers import run_ranks
from twin_checkpoints import save_twin_model

from batchgen import LLM
from batchgen.layers.batch_invariant import invariant_mode
from batchgen.layers.tp_group import TPGroup, rank_order_sum

NUM_PROMPTS = 16
PROBES = range(0, NUM_PROMPTS, 4)  # the prompts also run alone


def _parts(size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's part, rank 0 first: a cancelling column (1e8, 1, -1e8, ...: 1 is
    lost when added to 1e8 before -1e8 cancels it) beside random ones."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(5, 7, generator=gen).to(dtype) for _ in range(size)]
    for rank, value in enumerate([1e8, 1.0, -1e8][:size]):
        parts[rank][:, 0] = value
    return parts


def _reduce_on_ranks(tp: TPGroup) -> dict:
    """This rank's deterministic all-reduce of its part, float32 and bfloat16."""
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        mine = _parts(tp.size, dtype)[tp.rank].clone()
        with invariant_mode(True):
            got[dtype] = tp.all_reduce(mine)
    return got


def test_the_deterministic_all_reduce_adds_the_parts_in_rank_order(tmp_path):
    """Three ranks, the fewest whose sum has an order to fix (two parts add the same
    either way); more ranks run the same gather and rank_order_sum."""
    size = 3
    runs = run_ranks(_reduce_on_ranks, size, tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        parts = _parts(size, dtype)
        total = parts[0].float() + parts[1].float()
        for part in parts[2:]:
            total = total + part.float()
        want = total.to(dtype)
        for rank, run in enumerate(runs):
            assert torch.equal(run[dtype], want), f"rank {rank}, {dtype}"
            # (1e8 + 1) - 1e8: the 1 is lost in rank order (float32's step at 1e8 is 8)
            assert (run[dtype][:, 0] == 0).all(), f"rank {rank}, {dtype}"


def test_the_order_of_the_parts_changes_the_sum():
    """What fixing the order buys: the same parts added in another order give other bits."""
    parts = _parts(3, torch.float32)
    assert (rank_order_sum(parts)[:, 0] == 0).all()
    assert (rank_order_sum([parts[0], parts[2], parts[1]])[:, 0] == 1).all()
    bf16 = [p.to(torch.bfloat16) for p in _parts(3, torch.float32)]
    assert rank_order_sum(bf16).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def twin_model(tmp_path_factory):
    return save_twin_model(tmp_path_factory.mktemp("twins"), _prompts())


def _prompts() -> list[list[int]]:
    return mixed_prompts(11, NUM_PROMPTS)


def _tp2_rows(model: str, dtype: str, alone: bool, deterministic: bool = True, **kw) -> list[tuple]:
    """The PROBES prompts' rows from an engine of 2 tensor-parallel ranks: each prompt in
    an engine call of its own, or all NUM_PROMPTS in one call."""
    llm = LLM(
        model=model,
        device="cpu",
        dtype=dtype,
        max_model_len=256,
        tensor_parallel_size=2,
        deterministic=deterministic,
        **kw,
    )
    try:
        prompts, params = _prompts(), mixed_params(NUM_PROMPTS, 12)
        return probe_rows(llm, prompts, params, PROBES, alone)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_rows_are_the_same_alone_batched_and_chunked(twin_model, dtype):
    alone = _tp2_rows(twin_model, dtype, alone=True)
    assert len(alone) == len(PROBES) and all(len(r[0]) > 0 for r in alone)
    assert _tp2_rows(twin_model, dtype, alone=False) == alone
    assert _tp2_rows(twin_model, dtype, alone=False, max_num_batched_tokens=64) == alone


@pytest.mark.slow
def test_without_deterministic_the_same_tp2_runs_differ(twin_model):
    """The difference the mode removes exists here: batched, and chunked, some probe's
    row (its logprobs at least) differs from the prompt run alone."""
    alone = _tp2_rows(twin_model, "float32", alone=True, deterministic=False)
    batched = _tp2_rows(twin_model, "float32", alone=False, deterministic=False)
    chunked = _tp2_rows(
        twin_model, "float32", alone=False, deterministic=False, max_num_batched_tokens=64
    )
    assert sum(a != b for a, b in zip(alone, batched)) > 0
    assert sum(a != c for a, c in zip(alone, chunked)) > 0
