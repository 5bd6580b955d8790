"""A KDA layer split by heads over 2 gloo ranks against the whole layer: outputs through
a prefill and a decode step, and each rank's state slots holding exactly its heads (and
its q/k/v channels of the conv window)."""

from __future__ import annotations

import pytest
import torch
from kimi_checkpoints import random_kda_module
from tp_workers import kda_layer_runs, run_ranks

from batchgen.layers.kda import KimiDeltaAttention
from batchgen.layers.tp_group import TPGroup

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    linear_num_heads=4,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)


def checkpoint_tensors(config) -> dict[str, torch.Tensor]:
    """transformers' KDA module's tensors, under its names (projections of std 0.1: the
    outputs compared are well above rounding)."""
    hf = random_kda_module(config, std=0.1)
    return {name: t.clone() for name, t in hf.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(**CONFIG)
    g = torch.Generator().manual_seed(1)
    hidden = CONFIG["hidden_size"]
    steps = [  # (rows, slot, has_state): prefill across the 4-row chunks, then decode
        [(torch.randn(7, hidden, generator=g), 2, False), (torch.randn(3, hidden, generator=g), 0, False)],
        [(torch.randn(1, hidden, generator=g), 2, True), (torch.randn(1, hidden, generator=g), 0, True)],
    ]  # fmt: skip
    root = tmp_path_factory.mktemp("kda_tp")
    path = root / "layer.pt"
    torch.save({"config": CONFIG, "weights": checkpoint_tensors(config), "steps": steps}, path)
    return run_ranks(kda_layer_runs, 2, root / "ranks", str(path))


def test_split_heads_give_the_whole_layers_outputs(runs):
    for rank, run in enumerate(runs):
        full, part = run["full"], run["part"]
        assert len(part["outputs"]) == 2
        for step, (a, b) in enumerate(zip(part["outputs"], full["outputs"])):
            assert a.shape == b.shape == (b.shape[0], CONFIG["hidden_size"])
            assert b.abs().max() > 1e-3  # the layer computes something
            diff = (a - b).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}, step {step}: max |diff| {diff}"


def test_each_rank_keeps_its_own_heads_of_the_state(runs):
    heads, dim = CONFIG["linear_num_heads"], CONFIG["linear_head_dim"]
    local = heads // 2
    for rank, run in enumerate(runs):
        full, part = run["full"], run["part"]
        assert part["states"].shape[2] == local
        mine = slice(rank * local, (rank + 1) * local)
        assert torch.allclose(part["states"], full["states"][:, :, mine], atol=1e-6)
        assert full["states"][:, [0, 2]].abs().max() > 0  # the two requests' slots moved
        width = heads * dim
        channels = torch.cat(
            [
                torch.arange(rank * local * dim, (rank + 1) * local * dim) + i * width
                for i in range(3)
            ]
        )  # this rank's q, k and v channels
        assert torch.equal(part["windows"], full["windows"][..., channels])


def test_heads_must_split_evenly():
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(**dict(CONFIG, linear_num_heads=3))
    with pytest.raises(ValueError, match=r"linear_num_heads=3 .* size 2"):
        KimiDeltaAttention(config, 0, 0, tp=TPGroup(0, 2))


def test_the_decay_parameters_must_hold_every_rank_s_heads():
    from transformers import KimiLinearConfig

    layer = KimiDeltaAttention(KimiLinearConfig(**CONFIG), 0, 0, tp=TPGroup(1, 2))
    full = torch.arange(4.0).reshape(1, 1, 4, 1)
    layer.load("A_log", full)
    assert layer.A_log.flatten().tolist() == [2.0, 3.0]  # rank 1: heads 2 and 3
    with pytest.raises(ValueError, match="A_log"):
        layer.load("A_log", torch.zeros(3))
