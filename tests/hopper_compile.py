"""Triton kernels compiled for an H100 (sm_90) on a machine without a GPU, for the
*_compile_hopper tests: Triton's NVIDIA backend and bundled ptxas, in a child process
without TRITON_INTERPRET (tests/conftest.py sets it when there is no GPU, and it decides
at import what @triton.jit makes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
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


# the device-derived flags as a GPU launch sets them for bf16 inputs (on the CPU the
# wrappers set them for the interpreter): bf16 rounding by the hardware, libdevice's expf,
# products on tensor cores
GPU_FLAGS = {"RNE_BY_HAND": False, "LIBDEVICE_EXP": True, "LIBDEVICE": True, "DOT_F32": False}


def recorded_launches(call) -> list:
    """[(kernel, bound arguments {name: value}, launch options)] of every Triton launch
    that call() makes; nothing is launched (call may pass CPU tensors with a GPU's
    shapes; the wrappers' results are then left unwritten)."""
    from triton.runtime.jit import JITFunction

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(self.arg_names, args, strict=False)) | kwargs
        missing = set(self.arg_names) - set(bound)
        assert not missing, f"{self.__name__}: no value for {sorted(missing)}"
        launches.append((self, bound, options))

    run = JITFunction.run
    JITFunction.run = record
    try:
        call()
    finally:
        JITFunction.run = run
    return launches


def compile_launch(fn, bound: dict, options: dict) -> dict:
    """fn compiled for sm_90 as a GPU would compile this recorded launch: its constexpr
    parameters as constants (GPU_FLAGS' names set as on a GPU), every other argument
    specialized as Triton's launcher does (its type, an int 1 as a constant, 16-byte
    alignment or divisibility), the launch's warps and stages (Triton's defaults, 4 and 3,
    without); whether its products are on tensor cores (wgmma or mma.sync in the PTX)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constants[(i,)] = "constexpr", GPU_FLAGS.get(p.name, value)
            continue
        # what a launch makes of this value: its type, 1 as a constant, 16-divisibility
        kind, key = native_specialize_impl(
            CUDABackend, value, False, not p.do_not_specialize,
            not p.do_not_specialize_on_alignment,
        )  # fmt: skip
        signature[p.name] = kind
        if kind == "constexpr":
            constants[(i,)] = key
        elif key:
            attrs[(i,)] = CUDABackend.parse_attr(key)
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    opts = {"num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 3)}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = kernel.asm["ptx"]
    return {"kernel": fn.__name__, "tensor_cores": "wgmma.mma_async" in ptx or "mma.sync" in ptx}


def compile_cases(cases: dict) -> dict:
    """{name: each kernel a case's call launches, compiled (compile_launch), in launch
    order, or the error that stopped it (the compiler's message, for the case's test to
    report)}; cases: {name: (call, ...)}."""
    results = {}
    for name, (call, *_) in cases.items():
        try:
            results[name] = [compile_launch(*launch) for launch in recorded_launches(call)]
        except Exception:
            results[name] = traceback.format_exc()[-4000:]
    return results
