"""The rope-and-store launches compiled for an H100 (sm_90) on a machine without a GPU:
kernels/qk_norm_rope.py's `_qk_norm_rope_store_kernel` (the Llama family's decode and
prefill on Triton: q/k norm, rope, the K/V write) and kernels/mla_rope.py's
`_mla_rope_kernel` with STORE (MLA's latent rows written into the pages), with bf16 and
FP8 pages, as their wrappers launch them for W1's (Qwen3-0.6B) and DeepSeek-V3's shapes.
The interpreter, which runs these kernels in the other tests here, accepts programs the
compiler refuses: the first version of the fused kernel assigned one name different
shapes in the two branches of an `if` (k's half-width tile, v's full-width one), which
the interpreter ran and the compiler rejects.

A few seconds, so in the default set (the other *_compile_hopper files, minutes, are
slow). The compiles run in a child process without TRITON_INTERPRET (tests/conftest.py sets it
for this one when there is no GPU, and it decides at import what @triton.jit makes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hopper_compile import compile_for_hopper, compiled_in_child

FOUR_WARPS = SimpleNamespace(num_warps=4, num_stages=3)  # what the wrappers launch with
FP8_MAX = 448.0
# name: (cache dtype, q/k norm) for W1's shape: 16 heads, 8 KV heads, head_dim 128
LLAMA = {
    "llama bf16": ("bf16", True),
    "llama fp8 pages": ("fp8e4nv", True),
    "llama no norm": ("bf16", False),
}
# name: cache dtype for DeepSeek-V3's MLA: 128 heads, nope 128, rope 64, rank 512
MLA = {"mla bf16": "bf16", "mla fp8 pages": "fp8e4nv"}


def _llama(name: str) -> dict:
    from batchgen.kernels import qk_norm_rope

    cache, norm = LLAMA[name]
    constants = dict(
        NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, HAS_NORM=norm,
        CLAMP=FP8_MAX if cache != "bf16" else 0.0, BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64,
        BLOCK_D=128, RNE_BY_HAND=False,
    )  # fmt: skip
    pointers = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    pointers |= {"k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}"}

    def arg_type(arg: str) -> str:
        if arg.endswith("_ptr"):
            return pointers.get(arg, "*bf16")
        return "fp32" if arg == "eps" else "i32"

    fn = qk_norm_rope._qk_norm_rope_store_kernel
    return compile_for_hopper(fn, constants, FOUR_WARPS, arg_type)


def _mla(name: str) -> dict:
    from batchgen.kernels import mla_rope

    cache = MLA[name]
    constants = dict(
        NUM_HEADS=128, NOPE=128, ROPE=64, RANK=512, INTERLEAVED=True, PAGE_SIZE=16,
        STORE=True, CLAMP=FP8_MAX if cache != "bf16" else 0.0, BLOCK_H=128, BLOCK_HALF=32,
        BLOCK_C=512, RNE_BY_HAND=False,
    )  # fmt: skip
    pointers = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    pointers["lat_ptr"] = f"*{cache}"

    def arg_type(arg: str) -> str:
        if arg.endswith("_ptr"):
            return pointers.get(arg, "*bf16")
        return "fp32" if arg == "eps" else "i32"

    return compile_for_hopper(mla_rope._mla_rope_kernel, constants, FOUR_WARPS, arg_type)


def _compile_all() -> dict:
    results = {name: _llama(name) for name in LLAMA}
    return results | {name: _mla(name) for name in MLA}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_in_child(__file__, timeout=600)


@pytest.mark.parametrize("name", [*LLAMA, *MLA])
def test_rope_store_launch_compiles_for_hopper(compiled, name):
    assert name in compiled  # the child compiled it (it fails on the first that does not)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
