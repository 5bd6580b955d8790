"""The kernels of the default GPU decode and prefill path compiled for an H100 (sm_90) on
a machine without a GPU, launched as their public wrappers launch them on a GPU: W1's
shapes (Qwen3-0.6B: hidden 1024, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
vocabulary 151936, pages of 16), bf16 activations, bf16 and FP8 (fp8e4nv) pages where a
kernel reads or writes pages, the GPU tunings passed explicitly where a wrapper takes
them. The interpreter, which runs these kernels in the other tests, accepts programs the
compiler refuses (qk_norm_rope's store kernel once assigned one name different tile
shapes in the two branches of an `if`); this catches such a change made without a GPU.

Each case calls its wrapper with CPU tensors while tests/hopper_compile.py records the
Triton launches instead of running them, then compiles every recorded launch with
triton.compile for sm_90 (hopper_compile.GPU_FLAGS: the device-derived flags as a GPU
sets them). The compiles run in a child process without TRITON_INTERPRET (tests/conftest.py
sets it when there is no GPU, and it decides at import what @triton.jit makes). About
10 s with a cold Triton cache on two CPU cores, so in the default set."""

from __future__ import annotations

import json

import pytest
import torch
from hopper_compile import compile_cases, compiled_in_child

TOKENS, REQUESTS, PAGES = 64, 4, 64  # a decode batch; prefill: 4 requests of 16 rows
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, PAGE = 1024, 16, 8, 128, 3072, 151936, 16
LATENT = 576  # store_latent's row: DeepSeek-V3's rank 512 and rope 64 (W1 has no latent)


def _t(*shape, dtype=None):
    return torch.zeros(shape, dtype=dtype or torch.bfloat16)


def _pages(fp8: bool):
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    return _t(PAGES, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype), _t(
        PAGES, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype
    )


def _rms_norm(residual: bool):
    from batchgen.kernels.rms_norm import rms_norm

    extra = (_t(TOKENS, HIDDEN),) if residual else ()
    rms_norm(_t(TOKENS, HIDDEN), _t(HIDDEN), 1e-6, *extra)


def _silu_and_mul():
    from batchgen.kernels.silu_and_mul import launch_for, silu_and_mul

    silu_and_mul(_t(TOKENS, 2 * INTER), tuning=launch_for(INTER))


def _store_kv(fp8: bool):
    from batchgen.kernels.store_kv import store_kv

    k = _t(TOKENS, KV_HEADS, HEAD_DIM)
    store_kv(*_pages(fp8), k, k.clone(), _t(TOKENS, dtype=torch.int64))


def _store_latent(fp8: bool):
    from batchgen.kernels.store_kv import store_latent

    cache = _t(PAGES, PAGE, 1, LATENT, dtype=torch.float8_e4m3fn if fp8 else None)
    store_latent(cache, _t(TOKENS, LATENT), _t(TOKENS, dtype=torch.int64))


def _qk_norm_rope():
    from batchgen.kernels.qk_norm_rope import qk_norm_rope

    qkv = _t(TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    positions = _t(TOKENS, dtype=torch.int64)
    table = _t(4096, HEAD_DIM, dtype=torch.float32)
    weight = _t(HEAD_DIM)
    qk_norm_rope(qkv, positions, table, table, HEADS, KV_HEADS, weight, weight, 1e-6)


def _decode(fp8: bool):
    from batchgen.kernels import decode_attention as da

    q, seq_lens = _t(TOKENS, HEADS, HEAD_DIM), _t(TOKENS, dtype=torch.int32)
    page_table = _t(TOKENS, PAGES, dtype=torch.int32)
    # 4 splits (an H100's 132 SMs over 64 x 8 programs ask 2): the merge kernel runs too
    da.decode_attention(
        q, *_pages(fp8), page_table, seq_lens, HEAD_DIM**-0.5, num_splits=4,
        tuning=da.GPU_TUNING,
    )  # fmt: skip


def _prefill(fp8: bool, padded: bool = False):
    from batchgen.kernels import prefill_attention as pa

    q, lens = _t(TOKENS, HEADS, HEAD_DIM), _t(REQUESTS, dtype=torch.int32)
    page_table = _t(REQUESTS, PAGES, dtype=torch.int32)
    tuning = pa.GPU_TUNING_PADDED if padded else pa.GPU_TUNING
    pa.prefill_attention(
        q, *_pages(fp8), lens, lens, lens, page_table, TOKENS // REQUESTS, HEAD_DIM**-0.5,
        tuning=tuning,
    )  # fmt: skip


def _rows(dtype):
    return _t(TOKENS, dtype=dtype)


def _sample(logits_dtype, cut: bool):
    from batchgen.kernels.sampling import sample_tokens

    logits, f32 = _t(TOKENS, VOCAB, dtype=logits_dtype), torch.float32
    cut_arg = _rows(f32) if cut else None
    sample_tokens(logits, _rows(f32), _rows(torch.int64), _rows(torch.int64), cut_arg)


def _nucleus():
    from batchgen.kernels.sampling_nucleus import sample_nucleus

    f32, i64 = torch.float32, torch.int64
    logits = _t(TOKENS, VOCAB, dtype=f32)  # the penalties' float32 output
    sample_nucleus(logits, _rows(f32), _rows(i64), _rows(i64), _rows(f32))


def _penalties():
    from batchgen.kernels.penalties import penalized_logits

    f32 = torch.float32
    counts, mask = _t(TOKENS, VOCAB, dtype=torch.int32), _t(TOKENS, VOCAB, dtype=torch.bool)
    penalized_logits(
        _t(TOKENS, VOCAB), counts, mask, _rows(f32), _rows(f32), _rows(f32), _rows(torch.int64)
    )


# name: (the wrapper call, the kernels it launches in order); the first row is the default
CASES = {
    "rms_norm": (lambda: _rms_norm(False), ["_rms_norm_kernel"]),
    "rms_norm residual": (lambda: _rms_norm(True), ["_rms_norm_kernel"]),
    "silu_and_mul": (_silu_and_mul, ["_silu_and_mul_kernel"]),
    "store_kv bf16": (lambda: _store_kv(False), ["_store_kv_kernel"]),
    "store_kv fp8 pages": (lambda: _store_kv(True), ["_store_kv_kernel"]),
    "store_latent bf16": (lambda: _store_latent(False), ["_store_kv_kernel"]),
    "store_latent fp8 pages": (lambda: _store_latent(True), ["_store_kv_kernel"]),
    "qk_norm_rope": (_qk_norm_rope, ["_qk_norm_rope_kernel"]),
    "decode bf16": (lambda: _decode(False), ["_decode_split_kernel", "_decode_merge_kernel"]),
    "decode fp8 pages": (lambda: _decode(True), ["_decode_split_kernel", "_decode_merge_kernel"]),
    "prefill bf16": (lambda: _prefill(False), ["_prefill_kernel"]),
    "prefill fp8 pages": (lambda: _prefill(True), ["_prefill_kernel"]),
    "prefill padded tuning": (lambda: _prefill(False, padded=True), ["_prefill_kernel"]),
    "sample bf16": (lambda: _sample(None, cut=False), ["_sample_kernel"]),
    "sample fp32 cut": (lambda: _sample(torch.float32, cut=True), ["_sample_kernel"]),
    "nucleus": (_nucleus, ["_sample_kernel", "_mass_kernel", "_nucleus_kernel"]),
    "penalties": (_penalties, ["_penalty_kernel"]),
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_in_child(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_decode_path_launch_compiles_for_hopper(compiled, name):
    assert isinstance(compiled[name], list), compiled[name]  # else the compiler's error
    assert [c["kernel"] for c in compiled[name]] == CASES[name][1]


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("decode", "prefill"))])
def test_attention_products_on_tensor_cores(compiled, name):
    """The GPU program was compiled (DOT_F32 off: bf16 tl.dot on tensor cores), not the
    interpreter's float32-product variant."""
    assert isinstance(compiled[name], list), compiled[name]
    assert compiled[name][0]["tensor_cores"], compiled[name]


if __name__ == "__main__":
    print(json.dumps(compile_cases(CASES)))
