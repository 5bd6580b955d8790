"""Tensor parallel on 2 gloo ranks (spawned processes) against one process: each
parallel layer, then tiny Llama / Qwen3 / Qwen2 checkpoints through packed prefill and
decode steps, each rank over its own KV pool of num_kv_heads / 2 heads."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from conftest import save_tiny_model, tiny_config
from tp_workers import fail_on_rank_one, layers_and_models, model_logits, run_ranks

from batchgen.layers.parallel import ColumnParallelLinear, local_kv_heads
from batchgen.layers.tp_group import TPGroup
from batchgen.models.llama import LlamaForCausalLM

ARCHS = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for arch in ARCHS:
        save_tiny_model(root / arch, arch)
    return {arch: str(root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def tp2_runs(checkpoints, tmp_path_factory):
    """Each rank's results, rank 0 first (one spawn of 2 ranks for the module)."""
    return run_ranks(layers_and_models, 2, tmp_path_factory.mktemp("ranks"), checkpoints)


def test_each_parallel_layer_equals_the_full_layer_on_both_ranks(tp2_runs):
    assert len(tp2_runs) == 2
    for rank, diffs in enumerate(run["layers"] for run in tp2_runs):
        assert len(diffs) == 9
        for case, diff in diffs.items():
            assert diff <= 1e-5, f"rank {rank}, {case}: max |diff| {diff}"


def test_host_messages_travel_on_a_gloo_group_of_their_own(tp2_runs):
    """Under NCCL an object broadcast on the tensors' group is staged through GPU memory;
    every run makes the gloo side group, so the path NCCL runs is the one tested here."""
    assert [run["host_group"] for run in tp2_runs] == [("gloo", True), ("gloo", True)]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_equal_tp1_through_prefill_and_decode(arch, checkpoints, tp2_runs):
    """Qwen2 adds the qkv bias and tied embeddings (the embedding's vocabulary split
    serving as the lm_head)."""
    reference = model_logits(None, checkpoints[arch])
    assert len(reference) == 5
    for rank, run in enumerate(tp2_runs):
        assert len(run["logits"][arch]) == len(reference)
        for step, (mine, ref) in enumerate(zip(run["logits"][arch], reference)):
            assert mine.shape == ref.shape == (ref.shape[0], 512)
            diff = (mine - ref).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}, step {step}: max |diff| {diff}"


def test_a_rank_that_fails_fails_the_run_without_hanging(tmp_path):
    """Rank 1's error, or rank 0's connection to it closed or reset, whichever comes first,
    well within the group's 30 s timeout that a hung rank 0 would wait out. Timed from
    rank 1 giving up: starting two processes takes tens of seconds on a busy machine."""
    stamp = tmp_path / "gave_up"
    with pytest.raises(mp.ProcessRaisedException, match=r"rank 1 gives up|by peer"):
        run_ranks(fail_on_rank_one, 2, tmp_path / "ranks", str(stamp), timeout_s=300)
    assert time.time() - float(stamp.read_text()) < 20


def test_kv_heads_must_split_evenly_and_the_error_names_both_numbers():
    assert local_kv_heads(8, 4) == 2
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* tensor_parallel_size=4"):
        local_kv_heads(2, 4)
    config = tiny_config("LlamaForCausalLM")  # 4 heads, 2 KV heads
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 64, TPGroup(1, 2))
        assert model.num_local_kv_heads == 1
        assert model.layers[0].self_attn.num_heads == 2
        with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* tensor_parallel_size=4"):
            LlamaForCausalLM(config, 64, TPGroup(0, 4))


def test_a_shard_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match=r"shard 'k' rows=3 is not divisible by .* size 2"):
        ColumnParallelLinear(
            8, 10, shards={"q": (0, 4), "k": (4, 7), "v": (7, 10)}, tp=TPGroup(0, 2)
        )


def test_replicated_shards_are_whole_on_every_rank_and_the_rest_split():
    """Rows a rank holds, loaded shard by shard or from the whole stacked tensor: its
    half of q and b, all of f (KDA's in_proj: heads split, the low-rank input not)."""
    shards = {"q": (0, 4), "b": (4, 6), "f": (6, 9)}
    full = torch.arange(9 * 3, dtype=torch.float32).view(9, 3)
    for rank in range(2):
        want = torch.cat([full[2 * rank : 2 * rank + 2], full[4 + rank : 5 + rank], full[6:9]])
        layer = ColumnParallelLinear(3, 9, shards=shards, tp=TPGroup(rank, 2), replicated=("f",))
        assert layer.weight.shape == (6, 3) and layer.shards == {
            "q": (0, 2),
            "b": (2, 3),
            "f": (3, 6),
        }
        layer.load("weight", full)
        assert torch.equal(layer.weight, want)
        layer.weight.zero_()
        for name, (start, end) in shards.items():
            layer.load("weight", full[start:end], name)
        assert torch.equal(layer.weight, want)
    with pytest.raises(ValueError, match=r"replicated shards \['g'\]"):
        ColumnParallelLinear(3, 9, shards=shards, tp=TPGroup(0, 2), replicated=("g",))
    with pytest.raises(ValueError, match="gather_output with replicated shards"):
        ColumnParallelLinear(3, 9, shards=shards, tp=TPGroup(0, 2), replicated=("f",),
                             gather_output=True)  # fmt: skip
