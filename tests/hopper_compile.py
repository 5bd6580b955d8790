"""Triton kernels compiled for an H100 (sm_90) on a machine without a GPU, for the
*_compile_hopper tests: Triton's NVIDIA backend and bundled ptxas, in a child process
without TRITON_INTERPRET (tests/conftest.py sets it when there is no GPU, and it decides
at import what @triton.jit makes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def compile_for_hopper(fn, constants: dict, tuning, arg_type) -> dict:
    """fn compiled with `constants` as its constexprs, arg_type(name) the type of every
    other argument ("*bf16", "i32", ...), tuning's warps and stages; whether its products
    are on tensor cores (wgmma or mma.sync in the PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else arg_type(n) for n in names}
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {"tensor_cores": "wgmma.mma_async" in ptx or "mma.sync" in ptx}


def compiled_in_child(script: str, timeout: int) -> dict:
    """What `script` (a test file run as a program) prints last, as JSON; run without
    TRITON_INTERPRET, with this folder importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
