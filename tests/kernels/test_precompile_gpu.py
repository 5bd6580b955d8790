"""kernels/precompile.py on a GPU: a compile recorded by the watch, preloaded from its
data into an emptied kernel, serves the next launch without compiling again."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from batchgen.kernels.precompile import CompileWatch, precompile, preload_jobs

pytestmark = pytest.mark.gpu


@triton.jit
def _add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def test_a_recorded_compile_preloads_and_the_launch_does_not_compile_again():
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    with CompileWatch(record=True) as first:
        _add_one[(1,)](x, out, 100, BLOCK=128)
    kernel_id = f"{__name__}:_add_one"
    assert first.count == 1 and len(first.specs[kernel_id]) == 1
    _add_one.device_caches.clear()  # as in a new process: nothing compiled in memory
    index = x.device.index or 0
    jobs = preload_jobs(first.specs)
    assert precompile(jobs, 2, before=lambda: torch.cuda.set_device(index)) == 1
    out.zero_()
    with CompileWatch() as second:
        _add_one[(1,)](x, out, 100, BLOCK=128)
    assert torch.equal(out, x + 1)
    assert second.count == 0


def test_a_planned_compile_counts_whether_preloaded_or_launched_and_others_apart():
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    _add_one.device_caches.clear()
    with CompileWatch(record=True) as first:
        _add_one[(1,)](x, out, 100, BLOCK=128)
    index = x.device.index or 0
    _add_one.device_caches.clear()
    with CompileWatch(expected=first.specs) as preloaded:
        precompile(preload_jobs(first.specs), 2, before=lambda: torch.cuda.set_device(index))
        _add_one[(1,)](x, out, 100, BLOCK=256)  # a specialization the plan lacks
    assert (preloaded.count, preloaded.planned_done, preloaded.expected) == (2, 1, 1)
    _add_one.device_caches.clear()
    with CompileWatch(expected=first.specs) as launched:
        _add_one[(1,)](x, out, 100, BLOCK=128)
    assert (launched.count, launched.planned_done) == (1, 1)


def test_a_compile_preloaded_from_a_written_table_launches_right(tmp_path):
    """Through the table's file (written with sorted keys, as the shipped one is): the
    preloaded kernel takes its arguments in their places (a signature read back sorted
    once compiled _add_one for (BLOCK, n, out_ptr, x_ptr): its launch read a tensor as a
    scalar) and serves the launch without compiling again."""
    from batchgen.kernels.autotune_table import gpu_section, load_table, write_section

    x = torch.arange(100, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    _add_one.device_caches.clear()
    with CompileWatch(record=True) as first:
        _add_one[(1,)](x, out, 100, BLOCK=128)
    path = tmp_path / "table.json"
    write_section(path, "this GPU", {"compile": first.specs})
    _add_one.device_caches.clear()
    index = x.device.index or 0
    specs = gpu_section(load_table(path), "this GPU")["compile"]
    assert precompile(preload_jobs(specs), 2, before=lambda: torch.cuda.set_device(index)) == 1
    out.zero_()
    with CompileWatch() as second:
        _add_one[(1,)](x, out, 100, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.equal(out, x + 1)
    assert second.count == 0
