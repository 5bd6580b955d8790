"""The MLA, MoE, FP8, KDA and batch-invariant GEMM kernels compiled for an H100 (sm_90)
on a machine without a GPU, launched as their public wrappers launch them on a GPU, at
the shapes W4 (Moonlight / DeepSeek-V3: MLA with a 512-rank latent and 64-dim rope, 16
heads, hidden 2048, 64 routed experts of width 1408, top 6) and W6 (Kimi Linear: KDA with
16 heads of 128, a 4-tap short convolution over q, k and v; MoE experts of width 1024)
run with: a decode batch of 64 rows, a prefill step of 4 requests of 128 rows, bf16
activations, bf16 and FP8 (fp8e4nv) latent pages, the GPU tunings passed explicitly
where a wrapper would ask the device for them. The interpreter, which runs these kernels
in the other tests, accepts programs the compiler refuses; this catches such a change
made without a GPU (tests/kernels/test_decode_path_compile_hopper.py covers the dense
decode path, test_int4_compile_hopper.py and test_invariant_attention_compile_hopper.py
the INT4 and invariant-attention kernels).

Each case calls its wrapper with CPU tensors (left uninitialised: nothing runs) while
tests/hopper_compile.py records the Triton launches instead of running them, then
compiles every recorded launch for sm_90 in a child process without TRITON_INTERPRET.
About 11 s with a cold Triton cache on two CPU cores, so in the default set."""

from __future__ import annotations

import json

import pytest
import torch
from hopper_compile import compile_cases, compiled_in_child

TOKENS, PREFILL, REQUESTS, PAGES, PAGE = 64, 512, 4, 64, 16
HIDDEN, HEADS, RANK, ROPE = 2048, 16, 512, 64  # W4 and W6's MLA
EXPERTS, TOP_K, MOE_W4, MOE_W6 = 64, 6, 1408, 1024
KDA_HEADS, KDA_DIM, TAPS = 16, 128, 4  # W6's KDA
FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)  # DeepSeek-V3's FP8 weight blocks


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


def _ints(n: int, dtype=torch.int32):
    return torch.zeros(n, dtype=dtype)


def _mla(fp8: bool):
    from batchgen.kernels import mla_decode as md

    latent = _t(PAGES, PAGE, 1, RANK + ROPE, dtype=FP8 if fp8 else torch.bfloat16)
    page_table = torch.zeros(TOKENS, PAGES, dtype=torch.int32)
    # 4 splits: the merge kernel runs too
    md.mla_decode(
        _t(TOKENS, HEADS, RANK), _t(TOKENS, HEADS, ROPE), latent, page_table, _ints(TOKENS),
        0.1, num_splits=4, tuning=md.GPU_TUNING,
    )  # fmt: skip


def _aligned(rows: int, block_m: int):
    from batchgen.kernels.fused_moe import align_pairs

    return align_pairs(torch.zeros(rows * TOP_K, dtype=torch.int64), EXPERTS, block_m)


def _moe(width: int, down: bool):
    from batchgen.kernels.fused_moe import TUNING, moe_gemm

    n, k = (HIDDEN, width) if down else (2 * width, HIDDEN)
    a = _t(TOKENS * TOP_K if down else TOKENS, k)
    aligned = _aligned(TOKENS, TUNING.block_m)
    moe_gemm(a, _t(EXPERTS, n, k), *aligned, TOKENS * TOP_K, 1 if down else TOP_K)


def _fp8_moe(rows: int):
    from batchgen.kernels.fp8_moe import fp8_moe_gemm, tuning_for

    tuning = tuning_for(rows * TOP_K, EXPERTS)
    n, k = 2 * MOE_W4, HIDDEN
    w_scale = _t(EXPERTS, -(-n // 128), k // 128, dtype=torch.float32)
    fp8_moe_gemm(
        _t(rows, k, dtype=FP8), _t(rows, k // 128, dtype=torch.float32),
        _t(EXPERTS, n, k, dtype=FP8), w_scale, BLOCK, *_aligned(rows, tuning.block_m),
        rows * TOP_K, TOP_K, torch.bfloat16, tuning,
    )  # fmt: skip


def _fp8_gemm(rows: int, split_k: int = 1):
    from batchgen.kernels.fp8_gemm import Fp8GemmTuning, block_scaled_mm

    # fp8_gemm.default_tuning's GPU launches (it asks the device for its SM count when
    # M <= 16: an H100's 132 over 48 column tiles splits K by 2)
    if rows <= 16:
        tuning = Fp8GemmTuning(block_m=16, block_n=64, num_warps=4, num_stages=4, split_k=split_k)
    elif rows <= 64:
        tuning = Fp8GemmTuning(block_m=32, block_n=128, num_warps=4, num_stages=3)
    else:
        tuning = Fp8GemmTuning(block_m=64, block_n=128, num_warps=4, num_stages=3)
    n, k = HEADS * (128 + ROPE), HIDDEN  # W4's q_proj
    block_scaled_mm(
        _t(rows, k, dtype=FP8), _t(rows, k // 128, dtype=torch.float32), _t(n, k, dtype=FP8),
        _t(n // 128, k // 128, dtype=torch.float32), BLOCK, torch.bfloat16, tuning=tuning,
    )  # fmt: skip


def _fp8_quant():
    from batchgen.kernels.fp8_quant import quantize_groups

    quantize_groups(_t(TOKENS, HIDDEN), 128)


def _moe_combine(residual: bool):
    from batchgen.kernels.moe_combine import moe_combine

    extra = {"residual": _t(TOKENS, HIDDEN)} if residual else {}
    position = _ints(TOKENS * TOP_K, torch.int64)
    moe_combine(
        _t(TOKENS * TOP_K, HIDDEN), position, _t(TOKENS, TOP_K, dtype=torch.float32), **extra
    )


def _expert_select():
    from batchgen.kernels.expert_select import expert_select

    f32 = torch.float32
    expert_select(_t(TOKENS, EXPERTS, dtype=f32), _t(EXPERTS, dtype=f32), TOP_K, scale=2.446)


def _kda():
    from batchgen.kernels.kda_decode import kda_decode

    q = _t(TOKENS, KDA_HEADS, KDA_DIM)
    f32 = torch.float32
    kda_decode(
        q, q.clone(), q.clone(), q.clone(), _t(TOKENS, KDA_HEADS), _t(KDA_HEADS, dtype=f32),
        _t(KDA_HEADS * KDA_DIM, dtype=f32), _t(TOKENS, KDA_HEADS, KDA_DIM, KDA_DIM, dtype=f32),
        torch.arange(TOKENS, dtype=torch.int32),
    )  # fmt: skip


CHANNELS = 3 * KDA_HEADS * KDA_DIM  # q, k and v, convolved together


def _conv_decode():
    from batchgen.kernels.conv_decode import conv_decode

    windows = _t(TOKENS, TAPS - 1, CHANNELS)
    slots = torch.arange(TOKENS, dtype=torch.int32)
    conv_decode(_t(TOKENS, CHANNELS), _t(CHANNELS, TAPS), windows, slots, 3)


def _conv_packed():
    from batchgen.kernels.conv_packed import conv_packed

    windows = _t(REQUESTS, TAPS - 1, CHANNELS)
    cu = torch.arange(REQUESTS + 1, dtype=torch.int32) * (PREFILL // REQUESTS)
    slots = torch.arange(REQUESTS, dtype=torch.int32)
    conv_packed(_t(PREFILL, CHANNELS), _t(CHANNELS, TAPS), windows, cu, slots, 3)


def _invariant_mm():
    from batchgen.kernels.invariant_mm import GPU_TUNING, invariant_linear

    # an H100's 132 multiprocessors: the persistent grid's size
    invariant_linear(_t(TOKENS, HIDDEN), _t(3 * HIDDEN, HIDDEN), tuning=GPU_TUNING, programs=132)


MLA = ["_mla_split_kernel", "_mla_merge_kernel"]
# name: (the wrapper call, the kernels it launches in order); the first row is the default
CASES = {
    "mla_decode bf16": (lambda: _mla(False), MLA),
    "mla_decode fp8 latent": (lambda: _mla(True), MLA),
    "moe gate_up W4": (lambda: _moe(MOE_W4, down=False), ["_moe_gemm_kernel"]),
    "moe down W4": (lambda: _moe(MOE_W4, down=True), ["_moe_gemm_kernel"]),
    "moe gate_up W6": (lambda: _moe(MOE_W6, down=False), ["_moe_gemm_kernel"]),
    "moe_combine": (lambda: _moe_combine(False), ["_moe_combine_kernel"]),
    "moe_combine residual": (lambda: _moe_combine(True), ["_moe_combine_kernel"]),
    "expert_select": (_expert_select, ["_expert_select_kernel"]),
    "fp8_gemm decode": (lambda: _fp8_gemm(TOKENS), ["_block_scaled_mm_kernel"]),
    "fp8_gemm split k": (lambda: _fp8_gemm(8, split_k=2), ["_block_scaled_mm_kernel"]),
    "fp8_gemm prefill": (lambda: _fp8_gemm(PREFILL), ["_block_scaled_mm_kernel"]),
    "fp8_moe decode": (lambda: _fp8_moe(TOKENS), ["_fp8_moe_kernel"]),
    "fp8_moe prefill": (lambda: _fp8_moe(PREFILL), ["_fp8_moe_kernel"]),
    "fp8_quant": (_fp8_quant, ["_quantize_groups_kernel"]),
    "kda_decode": (_kda, ["_kda_decode_kernel"]),
    "conv_decode": (_conv_decode, ["_conv_decode_kernel"]),
    "conv_packed": (_conv_packed, ["_conv_packed_kernel", "_window_kernel"]),
    "invariant_mm": (_invariant_mm, ["_invariant_mm_kernel"]),
}
# the cases whose first kernel's product should be on tensor cores (bf16 or FP8 tl.dot)
TENSOR_CORES = [n for n in CASES if n.startswith(("mla", "moe ", "fp8_gemm", "fp8_moe", "inv"))]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_in_child(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_mla_kda_launch_compiles_for_hopper(compiled, name):
    assert isinstance(compiled[name], list), compiled[name]  # else the compiler's error
    assert [c["kernel"] for c in compiled[name]] == CASES[name][1]


@pytest.mark.parametrize("name", TENSOR_CORES)
def test_products_on_tensor_cores(compiled, name):
    """The GPU program was compiled (DOT_F32 off where a kernel has it), its product on
    wgmma or mma.sync, not the interpreter's float32-product variant."""
    assert isinstance(compiled[name], list), compiled[name]
    assert compiled[name][0]["tensor_cores"], compiled[name]


if __name__ == "__main__":
    print(json.dumps(compile_cases(CASES)))
