"""kernels/invariant_attention.py compiled for an H100 (sm_90) on a machine without a GPU:
the launches deterministic=True makes (decode one tile a program, prefill several, a
sliding window, FP8 pages, float32, MLA's 512 + 64 latent) build with Triton's NVIDIA
backend and bundled ptxas, their products on tensor cores where the inputs are bf16. The
interpreter, which runs the kernel in the other tests here, accepts programs the compiler
refuses (constexpr branches, tile helpers, early returns).

The compiles run in a child process without TRITON_INTERPRET (tests/conftest.py sets it
for this one when there is no GPU, and it decides at import what @triton.jit makes)."""

from __future__ import annotations

import json

import pytest
from hopper_compile import compile_for_hopper, compiled_in_child

pytestmark = pytest.mark.slow

GQA = dict(GROUP=2, HEAD_DIM=128, V_DIM=128, ROPE_DIM=0, BLOCK_D=128, BLOCK_DV=128, BLOCK_R=16)
MLA = dict(GROUP=16, HEAD_DIM=512, V_DIM=512, ROPE_DIM=64, BLOCK_D=512, BLOCK_DV=512, BLOCK_R=64)
# name: (geometry, subtiles, has_window, cache dtype, query dtype)
LAUNCHES = {
    "gqa decode": (GQA, 1, False, "bf16", "bf16"),
    "gqa prefill": (GQA, 4, False, "bf16", "bf16"),
    "gqa prefill window": (GQA, 4, True, "bf16", "bf16"),
    "gqa fp8 pages": (GQA, 4, False, "fp8e4nv", "bf16"),
    "gqa float32": (GQA, 2, False, "fp32", "fp32"),
    "mla decode": (MLA, 1, False, "bf16", "bf16"),
    "mla prefill": (MLA, 2, False, "bf16", "bf16"),
}


def _compile(name: str) -> dict:
    from batchgen.kernels import invariant_attention as ia

    geometry, subtiles, window, cache, dtype = LAUNCHES[name]
    # default_tuning's choice on a GPU (it keys on the tensor's device, absent here)
    wide = dtype == "fp32" or geometry["HEAD_DIM"] + geometry["ROPE_DIM"] > 256
    tuning = ia.GPU_TUNING_NARROW if wide else ia.GPU_TUNING
    constants = dict(
        geometry, PAGE_SIZE=16, HAS_WINDOW=window, DOT_F32=dtype == "fp32",
        BLOCK_M=tuning.block_m, SUBTILES=subtiles, BLOCK_N=tuning.block_n,
    )  # fmt: skip

    def arg_type(arg: str) -> str:
        if arg in ("k_ptr", "v_ptr", "kr_ptr"):
            return f"*{cache}"
        if arg in ("q_ptr", "out_ptr", "qr_ptr"):
            return f"*{dtype}"
        if arg.endswith("_ptr"):
            return "*i64"
        return "fp32" if arg == "scale_log2" else "i32"

    return compile_for_hopper(ia._invariant_kernel, constants, tuning, arg_type)


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_in_child(__file__, timeout=900)


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_invariant_launches_compile_for_hopper(compiled, name):
    on_tensor_cores = LAUNCHES[name][4] == "bf16"  # float32 multiplies in IEEE on CUDA cores
    assert compiled[name]["tensor_cores"] == on_tensor_cores


if __name__ == "__main__":
    print(json.dumps({name: _compile(name) for name in LAUNCHES}))
