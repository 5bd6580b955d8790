"""Why the kernels are written as they are for the Triton releases the package accepts,
and why the test extra asks for triton >= 3.7 on the CPU.

- triton 3.9's interpreter broadcasts a scalar int1 to int32 when it meets a block in
  `&`, and tl.load refuses the result as a mask ("mask has unsupported dtype"). A kernel
  folds a scalar condition into a block mask with tl.where instead (kernels/kda_decode.py).
- triton 3.6's interpreter turns a loop bound loaded from memory into a Python int with
  int() on a one-element array, which numpy >= 2.4 refuses ("only 0-dimensional arrays can
  be converted to Python scalars"); 3.7 squeezes the array first. Compiled on a GPU, 3.6
  is fine: the bound in pyproject.toml is the test extra's, for the interpreter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _scalar_in_block_mask(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = row < n  # a scalar condition, as a program's "is my pair real"
    mask = tl.where(live, cols < BLOCK - 1, False)
    x = tl.load(x_ptr + row * BLOCK + cols, mask=mask, other=-1.0)
    tl.store(out_ptr + row * BLOCK + cols, x)


@triton.jit
def _loop_bound_from_memory(bounds_ptr, out_ptr):
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + 1)
    total = 0
    for i in range(lo, hi):
        total += i
    tl.store(out_ptr, total)


def test_a_scalar_condition_folds_into_a_block_mask():
    block, rows, live_rows = 8, 3, 2
    x = torch.arange(rows * block, dtype=torch.float32, device=DEVICE)
    out = torch.full_like(x, float("nan"))
    _scalar_in_block_mask[(rows,)](x, out, live_rows, BLOCK=block)
    want = x.clone().view(rows, block)
    want[:, block - 1] = -1.0
    want[live_rows:] = -1.0
    assert torch.equal(out.view(rows, block), want)


def test_a_loop_bound_loaded_from_memory():
    bounds = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    _loop_bound_from_memory[(1,)](bounds, out)
    assert out.item() == sum(range(3, 9))


def test_the_test_extra_asks_for_a_triton_whose_interpreter_runs_with_this_numpy():
    """numpy >= 2.4 refuses int() of a one-element array, which triton 3.6's interpreter
    does for every loop bound it loads: the test extra must not admit 3.6 then."""
    pyproject = tomllib.loads(
        (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    )
    spec = next(s for s in pyproject["project"]["optional-dependencies"]["test"] if "triton" in s)
    low = tuple(int(p) for p in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))
    numpy_version = tuple(int(p) for p in np.__version__.split(".")[:2])
    if numpy_version >= (2, 4):
        with pytest.raises(TypeError, match="0-dimensional"):
            int(np.zeros(1))
        assert low >= (3, 7), f"{spec!r} admits triton 3.6, whose interpreter fails here"
    installed = tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())
    if INTERPRETED:
        assert installed >= low[:2]
