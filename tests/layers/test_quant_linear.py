"""Linear layers holding block-scaled FP8 weights (layers/quant): parameters as stored,
shards and tensor-parallel slices cut in the scales' block units, the CPU product equal
to the product with the dequantized weight, and a float weight quantized as it loads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_blocks import quantize_blocks

from batchgen.kernels.fp8_gemm import block_scaled_mm
from batchgen.kernels.fp8_quant import quantize_groups
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.parallel import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.quant.fp8 import (
    Fp8BlockMethod,
    dequantize,
    dequantized_linear,
)
from batchgen.layers.quant.fp8 import (
    quantize_blocks as package_quantize,
)
from batchgen.layers.tp_group import TPGroup

BLOCK = (16, 32)


def fp8_weight(out: int, inp: int, seed: int):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    return quantize_blocks(w, BLOCK)


def test_a_stacked_layer_holds_each_shard_as_stored_and_multiplies_as_dequantized():
    shards = merged_shards({"q": 32, "k": 16, "v": 16})
    layer = Linear(70, 64, shards=shards)
    layer.use_method(Fp8BlockMethod(BLOCK))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (64, 70)
    assert layer.weight_scale_inv.shape == (4, 3)
    parts = {name: fp8_weight(e - s, 70, seed=s) for name, (s, e) in shards.items()}
    for name, (q, scale) in parts.items():
        layer.load("weight", q, name)
        layer.load("weight_scale_inv", scale, name)
    full = torch.cat([dequantize(q, s, BLOCK) for q, s in parts.values()])
    x = torch.randn(5, 70)
    assert torch.equal(layer(x), F.linear(x, full))
    assert torch.equal(layer.dense_weight(), full)
    assert layer.shard_names("weight_scale_inv") == ["q", "k", "v"]
    assert layer.filled_by("weight", parts["q"][0]) == ("weight",)


def test_the_tile_path_holds_one_tile_and_gives_the_whole_product():
    q, scale = fp8_weight(100, 40, seed=1)
    x = torch.randn(3, 40, dtype=torch.float64).float()
    whole = F.linear(x, dequantize(q, scale, BLOCK))
    bias = torch.randn(100)
    tiled = dequantized_linear(x, q, scale, BLOCK, bias, tile_elements=16 * 40)  # 7 tiles
    assert torch.allclose(tiled, whole + bias, rtol=1e-6, atol=1e-6)
    bf16 = dequantized_linear(x.bfloat16(), q, scale, BLOCK, tile_elements=32 * 40)
    want = F.linear(x.bfloat16(), dequantize(q, scale, BLOCK).bfloat16())
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, want)


def test_a_shard_inside_a_block_keeps_blocks_of_its_own():
    """Shards a (24 rows) and b (16): b starts inside a 16-row block of the whole, so
    each shard keeps the blocks its checkpoint tensor has (a: 2, the second partial; b:
    1), and every path multiplies by each row's own shard's scales."""
    shards = merged_shards({"a": 24, "b": 16})
    layer = Linear(64, 40, shards=shards)
    layer.use_method(Fp8BlockMethod(BLOCK))
    assert layer.weight_scale_inv.shape == (3, 2)
    parts = {name: fp8_weight(e - s, 64, seed=e) for name, (s, e) in shards.items()}
    for name, (q, scale) in parts.items():
        layer.load("weight", q, name)
        layer.load("weight_scale_inv", scale, name)
    layer.after_load()
    assert layer.weight_scale_inv_rows.tolist() == [0] * 16 + [1] * 8 + [2] * 16
    full = torch.cat([dequantize(q, s, BLOCK) for q, s in parts.values()])
    assert torch.equal(layer.dense_weight(), full)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), F.linear(x, full))
    tiled = dequantized_linear(
        x, layer.weight, layer.weight_scale_inv, BLOCK, tile_elements=16 * 64,
        unit_index=layer.weight_scale_inv_rows,
    )  # fmt: skip
    # tiles of 16 rows against one product: equal up to float32 rounding (rtol 1.3e-6,
    # atol 1e-5), as a BLAS may block a 16-row product unlike a 40-row one
    torch.testing.assert_close(tiled, F.linear(x, full))
    # the W8A8 kernel (the interpreter on the CPU) with the row index
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, a_scale = quantize_groups(x.to(dev), BLOCK[1])
    w, scale, index = (layer.weight, layer.weight_scale_inv, layer.weight_scale_inv_rows)
    got = block_scaled_mm(
        a, a_scale, w.to(dev), scale.to(dev), BLOCK, torch.float32, w_scale_rows=index.to(dev)
    )
    a_dequantized = a.float() * a_scale.repeat_interleave(BLOCK[1], 1)
    want = F.linear(a_dequantized, full.to(dev))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="stays plain"):
        Linear(64, 32, quantizable=False).use_method(Fp8BlockMethod(BLOCK))


def test_a_float_weight_is_quantized_as_it_loads():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    layer = Linear(64, 48, shards=merged_shards({"gate": 32, "up": 16}))
    layer.use_method(Fp8BlockMethod(BLOCK))
    assert layer.filled_by("weight", w) == ("weight", "weight_scale_inv")
    layer.load("weight", w[:32], "gate")
    layer.load("weight", w[32:], "up")
    q, scale = package_quantize(w, BLOCK)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, scale)
    assert (layer.dense_weight() - w).abs().max() < 0.07 * w.abs().max()  # e4m3: 3 bits


def test_tensor_parallel_slices_cut_the_scales_by_blocks():
    """Column-parallel ranks hold their rows of each shard, row-parallel ranks their
    columns; every rank's partial product is the slice (or summand) of the whole."""
    (qa, sa), (qb, sb) = fp8_weight(32, 64, seed=3), fp8_weight(64, 64, seed=4)
    full = torch.cat([dequantize(qa, sa, BLOCK), dequantize(qb, sb, BLOCK)])
    x = torch.randn(3, 64)
    shards = merged_shards({"a": 32, "b": 64})
    outs = []
    for rank in range(2):
        layer = ColumnParallelLinear(64, 96, shards=shards, tp=TPGroup(rank, 2))
        layer.use_method(Fp8BlockMethod(BLOCK))
        assert layer.weight_scale_inv.shape == (3, 2)
        for name, q, s in (("a", qa, sa), ("b", qb, sb)):
            layer.load("weight", q, name)
            layer.load("weight_scale_inv", s, name)
        outs.append(layer.matmul(x, None))
    want = F.linear(x, full)
    got = torch.cat([outs[0][:, :16], outs[1][:, :16], outs[0][:, 16:], outs[1][:, 16:]], 1)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)

    q, s = fp8_weight(48, 128, seed=5)
    total = 0
    for rank in range(2):
        layer = RowParallelLinear(128, 48, tp=TPGroup(rank, 2))
        layer.use_method(Fp8BlockMethod(BLOCK))
        layer.load("weight", q)
        layer.load("weight_scale_inv", s)
        total = total + layer.matmul(x.repeat(1, 2)[:, rank * 64 : (rank + 1) * 64], None)
    assert torch.allclose(total, F.linear(x.repeat(1, 2), dequantize(q, s, BLOCK)), atol=1e-4)


def test_a_rank_slice_inside_a_block_is_refused():
    with pytest.raises(ValueError, match="not whole 16-row units"):
        ColumnParallelLinear(64, 48, tp=TPGroup(0, 2)).use_method(Fp8BlockMethod(BLOCK))
    with pytest.raises(ValueError, match="not whole 32-column units"):
        RowParallelLinear(96, 16, tp=TPGroup(0, 2)).use_method(Fp8BlockMethod(BLOCK))


def test_a_float_weight_fills_each_shard_in_its_own_blocks():
    """Online quantization of a stacked layer whose second shard starts inside a block,
    shard by shard and from one whole tensor: the same parameters as that shard's own
    quantize_blocks."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(6))
    shards = merged_shards({"a": 24, "b": 16})
    by_shard, whole = Linear(64, 40, shards=shards), Linear(64, 40, shards=shards)
    for layer in (by_shard, whole):
        layer.use_method(Fp8BlockMethod(BLOCK))
    by_shard.load("weight", w[:24], "a")
    by_shard.load("weight", w[24:], "b")
    whole.load("weight", w)
    q, scale = package_quantize(w[24:], BLOCK)
    for layer in (by_shard, whole):
        assert torch.equal(layer.weight[24:].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv[2:], scale)
    assert torch.equal(by_shard.weight_scale_inv, whole.weight_scale_inv)


def test_in_deterministic_mode_a_row_gets_the_same_bits_alone_and_in_a_batch():
    """batch_invariant's mode (EngineConfig.deterministic): the tile path multiplies
    through batch_invariant.linear, so row 0 alone equals row 0 of 37 rows."""
    from batchgen.layers.batch_invariant import invariant_mode

    q, scale = fp8_weight(96, 64, seed=8)
    layer = Linear(64, 96)
    layer.use_method(Fp8BlockMethod(BLOCK))
    layer.load("weight", q)
    layer.load("weight_scale_inv", scale)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(8))
    with invariant_mode(True):
        alone, batch = layer(x[:1]), layer(x)
    assert torch.equal(alone[0], batch[0])
