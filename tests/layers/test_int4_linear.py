"""Linear layers holding INT4 pack-quantized weights (layers/quant/int4.py): the packed
words and scales as stored, shards and tensor-parallel slices cut in their units (8
columns a word, a group a scale), the CPU product equal to the product with the
dequantized weight, and a rank slice that would split a group refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from int4_blocks import quantize_int4

from batchgen.kernels.int4_gemm import dequantize_int4
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.parallel import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.quant.int4 import Int4Method
from batchgen.layers.tp_group import TPGroup


def int4_weight(out: int, inp: int, seed: int, group: int = 32):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    packed, scale = quantize_int4(w, group)
    return packed, scale, dequantize_int4(packed, scale, inp, group)


def test_a_stacked_layer_holds_each_shard_packed_and_multiplies_as_dequantized():
    shards = merged_shards({"q": 32, "k": 16, "v": 16})
    layer = Linear(96, 64, bias=True, shards=shards)
    layer.use_method(Int4Method(32, torch.float32))
    assert layer.weight_packed.dtype == torch.int32 and layer.weight_packed.shape == (64, 12)
    assert layer.weight_scale.shape == (64, 3) and not hasattr(layer, "weight")
    parts = {name: int4_weight(e - s, 96, seed=s) for name, (s, e) in shards.items()}
    for name, (packed, scale, _) in parts.items():
        layer.load("weight_packed", packed, name)
        layer.load("weight_scale", scale, name)
    bias = torch.randn(64)
    layer.load("bias", bias)
    full = torch.cat([dense for _, _, dense in parts.values()])
    x = torch.randn(2, 3, 96)
    torch.testing.assert_close(layer(x), F.linear(x, full, bias), rtol=1e-6, atol=1e-6)
    assert torch.equal(layer.dense_weight(), full)
    assert layer.shard_names("weight_scale") == ["q", "k", "v"]
    with pytest.raises(ValueError, match="weight_packed, weight_scale"):
        layer.load("weight", full)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_slices_are_cut_in_words_and_groups(rank):
    """Column-parallel rows and row-parallel columns of rank `rank` of 2: the packed
    words and scales of its slice, so its product is its slice of the dequantized one."""
    tp = TPGroup(rank=rank, size=2)
    packed, scale, dense = int4_weight(48, 128, seed=3)
    col = ColumnParallelLinear(128, 48, tp=tp)
    col.use_method(Int4Method(32, torch.float32))
    col.load("weight_packed", packed)
    col.load("weight_scale", scale)
    x = torch.randn(4, 128)
    rows = slice(rank * 24, (rank + 1) * 24)
    torch.testing.assert_close(col(x), F.linear(x, dense[rows]), rtol=1e-6, atol=1e-6)

    packed, scale, dense = int4_weight(40, 128, seed=4)
    row = RowParallelLinear(128, 40, tp=tp, reduce_output=False)
    row.use_method(Int4Method(32, torch.float32))
    row.load("weight_packed", packed)
    row.load("weight_scale", scale)
    cols = slice(rank * 64, (rank + 1) * 64)
    x = torch.randn(4, 64)
    torch.testing.assert_close(row(x), F.linear(x, dense[:, cols]), rtol=1e-6, atol=1e-6)


def test_a_rank_slice_inside_a_group_keeps_the_layer_plain():
    row = RowParallelLinear(64, 16, tp=TPGroup(rank=0, size=2))  # 32 columns a rank
    with pytest.raises(ValueError, match="128-column units of weight_scale"):
        row.use_method(Int4Method(128, torch.float32))
    assert row.quant is None and row.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 8"):
        Int4Method(12)
