"""kernels/int4_gemm.py (W4A16 over compressed-tensors' packed INT4 weights) and
kernels/int4_moe.py (the routed experts' GEMM over token-sorted pairs) against torch
references, on small random inputs in both group sizes.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets it); with
CUDA the same cases run compiled. float32 products are IEEE on both, so the outputs agree
to float32 rounding of another summation order; bfloat16 outputs to one rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from int4_blocks import quantize_int4

from batchgen.kernels.fused_moe import align_pairs
from batchgen.kernels.int4_gemm import (
    DECODE_TUNING,
    LARGE_TUNING,
    PREFILL_TUNING,
    W4A16Tuning,
    choose_tuning,
    dequantize_int4,
    int4_linear_torch,
    unpack_int4,
    w4a16_gemm,
    w4a16_reference,
)
from batchgen.kernels.int4_moe import Int4MoETuning, int4_moe_gemm, tuning_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = W4A16Tuning(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)


def _weights(n: int, k: int, group: int, gen: torch.Generator, experts: int | None = None):
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(*shape, generator=gen) / k**0.5
    packed, scale = quantize_int4(w, group)
    return packed.to(DEVICE), scale.to(DEVICE)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite outputs (left unwritten?)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of float32 sums taken in another order
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


def test_unpack_reads_the_compressed_tensors_packing():
    """Our nibble order is the library's: its unpack and ours give the same integers,
    and column 8w + j sits in bits 4j of word w as q + 8."""
    from compressed_tensors.compressors import pack_to_int32, unpack_from_int32

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (6, 40), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert packed.shape == (6, 5) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed, 40), q)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size((6, 40))), q)
    word = packed[2, 3].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == (q[2, 24:32] + 8).tolist()


def test_dequantize_is_q_times_its_group_scale():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 80, generator=gen)
    packed, scale = quantize_int4(w, 32)  # 80 columns: a partial third group
    out = dequantize_int4(packed, scale, 80, 32)
    q = unpack_int4(packed, 80)
    for i, j in [(0, 0), (1, 31), (2, 32), (4, 79), (3, 64)]:
        assert out[i, j].item() == q[i, j].item() * scale[i, j // 32].float().item()
    assert (out - w).abs().max() <= scale.float().max() / 2 + 1e-6  # within half a step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize(
    ("m", "n", "k", "tuning"),
    [
        (1, 40, 256, SMALL),  # a decode row; N past the last block
        (5, 33, 96, SMALL),  # K past the last block_k
        (3, 48, 256, W4A16Tuning(16, 16, 32, split_k=3, num_warps=1, num_stages=1)),
        (20, 24, 128, W4A16Tuning(32, 16, 64, num_warps=2, num_stages=1)),
        (4, 24, 80, W4A16Tuning(16, 16, 64, num_warps=1, num_stages=1)),  # a partial group
    ],
)
def test_w4a16_matches_the_reference(dtype, group, m, n, k, tuning):
    """Both ways of unpacking a tile (a word split by a reshape, or gathered per row)."""
    gen = torch.Generator().manual_seed(m * 100 + n)
    packed, scale = _weights(n, k, group, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    ref = w4a16_reference(x, packed, scale, group)
    for gather in (False, True):
        tn = dataclasses.replace(tuning, gather=gather)
        _close(w4a16_gemm(x, packed, scale, group, tuning=tn), ref)


def test_the_default_launches_and_a_strided_input():
    """choose_tuning's launches (decode and prefill split along K, 128-row tiles), x a
    view of wider rows."""
    gen = torch.Generator().manual_seed(2)
    packed, scale = _weights(64, 512, 32, gen)
    for m in (2, 40, 300):
        x = torch.randn(m, 520, generator=gen).to(DEVICE)[:, 8:]
        _close(w4a16_gemm(x, packed, scale, 32), w4a16_reference(x, packed, scale, 32))


def test_choose_tuning_splits_k_only_for_few_rows_and_tiles():
    few = choose_tuning(4, n=256, k=7168, num_sms=132)
    assert few.block_m == DECODE_TUNING.block_m and few.split_k > 1
    assert 7168 // (few.block_k * few.split_k) >= 4  # each split keeps 4+ steps
    assert choose_tuning(4, n=16384, k=7168, num_sms=132).split_k == 1  # tiles fill the GPU
    mid = choose_tuning(64, n=256, k=7168, num_sms=132)  # 2 tiles of 64 x 128: split too
    assert mid.block_m == PREFILL_TUNING.block_m and mid.split_k > 1
    assert choose_tuning(4096, n=4096, k=7168, num_sms=132) == LARGE_TUNING


def test_w4a16_checks_its_inputs():
    gen = torch.Generator().manual_seed(3)
    packed, scale = _weights(16, 64, 32, gen)
    x = torch.randn(2, 64, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="want float"):
        w4a16_gemm(x, packed, scale[:, :1], 32)
    with pytest.raises(ValueError, match="want int32"):
        w4a16_gemm(x[:, :56], packed, scale, 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16_gemm(x, packed, scale, 12)


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_path_dequantizes_a_block_of_rows_at_a_time(bias):
    """int4_linear_torch in blocks of 7 rows equals F.linear over the whole weight, up to
    float32 rounding (a BLAS may block a 7-row product unlike a 30-row one)."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(30, 64, generator=gen)
    packed, scale = quantize_int4(w, 32)
    b = torch.randn(30, generator=gen) if bias else None
    x = torch.randn(3, 2, 64, generator=gen)
    ref = torch.nn.functional.linear(x, dequantize_int4(packed, scale, 64, 32), b)
    out = int4_linear_torch(x, packed, scale, 32, b, block_rows=7)
    torch.testing.assert_close(out, ref)  # float32's: rtol 1.3e-6, atol 1e-5


def _moe_reference(a, packed, scale, group, experts_of, rows_per_token):
    """Each pair's row times its expert's dequantized weight, one pair at a time."""
    out = torch.zeros(experts_of.numel(), packed.shape[1], dtype=a.dtype, device=a.device)
    for p, e in enumerate(experts_of.tolist()):
        if e < packed.shape[0]:
            row = a[p // rows_per_token : p // rows_per_token + 1]
            out[p] = w4a16_reference(row, packed[e], scale[e], group)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows_per_token", [1, 2])
def test_int4_moe_gemm_matches_the_reference(dtype, group, rows_per_token):
    """Pairs of 4 experts (one id, 4, outside the rank's block: left unwritten) through
    align_pairs' blocks; gate_up's shape (rows_per_token 2: top-2 pairs read one token
    row) and down's (1: one row a pair)."""
    gen = torch.Generator().manual_seed(5 + group)
    num_experts, n, k, tokens = 4, 40, 256, 9
    packed, scale = _weights(n, k, group, gen, experts=num_experts)
    pairs = tokens * rows_per_token
    experts_of = torch.randint(0, num_experts + 1, (pairs,), generator=gen).to(DEVICE)
    a = torch.randn(pairs // rows_per_token, k, generator=gen).to(DEVICE, dtype)
    ref = _moe_reference(a, packed, scale, group, experts_of, rows_per_token)
    mine = experts_of < num_experts
    for gather in (False, True):
        tuning = Int4MoETuning(16, 16, 64, num_warps=1, num_stages=1, gather=gather)
        aligned = align_pairs(experts_of, num_experts, tuning.block_m)
        out = int4_moe_gemm(a, packed, scale, group, *aligned, pairs, rows_per_token, tuning)
        _close(out[mine], ref[mine])


@pytest.mark.parametrize(("tokens", "rows"), [(6, 16), (40, 32), (90, 64), (260, 128)])
def test_each_launch_tuning_for_picks_matches_the_reference(tokens, rows):
    """tuning_for's 16-, 32-, 64- and 128-row blocks (2 experts, top 1: tokens / 2 rows
    each)."""
    gen = torch.Generator().manual_seed(tokens)
    packed, scale = _weights(40, 128, 32, gen, experts=2)
    tuning = tuning_for(tokens, 2)
    assert tuning.block_m == rows
    experts_of = torch.randint(0, 2, (tokens,), generator=gen).to(DEVICE)
    a = torch.randn(tokens, 128, generator=gen).to(DEVICE)
    aligned = align_pairs(experts_of, 2, tuning.block_m)
    out = int4_moe_gemm(a, packed, scale, 32, *aligned, tokens, 1, tuning)
    _close(out, _moe_reference(a, packed, scale, 32, experts_of, 1))
