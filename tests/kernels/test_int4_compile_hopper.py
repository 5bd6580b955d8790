"""The INT4 kernels compiled for an H100 (sm_90) on a machine without a GPU: Triton's
NVIDIA backend and its bundled ptxas build the launches the engine picks, so kernels
that only the interpreter runs here are known to compile for the device too (the
interpreter accepts programs the compiler refuses, and runs no layout passes). Each
launch's product must be on tensor cores (wgmma or mma.sync in the PTX).

The compiles run in a child process without TRITON_INTERPRET (tests/conftest.py sets it
for this one when there is no GPU, and it decides at import what @triton.jit makes)."""

from __future__ import annotations

import json

import pytest
from hopper_compile import compile_for_hopper, compiled_in_child

pytestmark = pytest.mark.slow

DENSE_ROWS = (1, 64, 4096)  # the decode, prefill and large launches of choose_tuning
MOE_ROWS = (10, 48, 200)  # rows an expert: tuning_for's 16-, 64- and 128-row blocks


def _compile(fn, constants: dict, tuning, pointers: dict) -> dict:
    def arg_type(name: str) -> str:
        return pointers.get(name, "*bf16") if name.endswith("_ptr") else "i32"

    return compile_for_hopper(fn, constants, tuning, arg_type)


def _compile_all() -> dict:
    from batchgen.kernels import int4_gemm, int4_moe

    results = {}
    pointers = {"packed_ptr": "*i32", "scale_ptr": "*bf16", "ids_ptr": "*i64"}
    pointers |= {"block_expert_ptr": "*i32", "num_blocks_ptr": "*i32"}
    for m in DENSE_ROWS:
        for gather in (False, True):
            tuning = int4_gemm.choose_tuning(m, 4096, 7168, num_sms=132)
            constants = dict(
                GROUP=32, BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n,
                BLOCK_K=tuning.block_k, DOT_F32=False, RNE_BY_HAND=False, GATHER=gather,
            )  # fmt: skip
            fn = int4_gemm._w4a16_kernel
            results[f"w4a16 {m} {gather}"] = _compile(fn, constants, tuning, pointers)
    for rows in MOE_ROWS:
        tuning = int4_moe.tuning_for(rows * 64, 64)
        constants = dict(
            GROUP=32, ROWS_PER_TOKEN=8, BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n,
            BLOCK_K=tuning.block_k, DOT_F32=False, RNE_BY_HAND=False, GATHER=tuning.gather,
        )  # fmt: skip
        fn = int4_moe._int4_moe_kernel
        results[f"moe {rows}"] = _compile(fn, constants, tuning, pointers)
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_in_child(__file__, timeout=600)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("m", DENSE_ROWS)
def test_w4a16_launches_compile_for_hopper_on_tensor_cores(compiled, m, gather):
    assert compiled[f"w4a16 {m} {gather}"]["tensor_cores"]


@pytest.mark.parametrize("rows", MOE_ROWS)
def test_int4_moe_launches_compile_for_hopper_on_tensor_cores(compiled, rows):
    assert compiled[f"moe {rows}"]["tensor_cores"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
