"""engine/kernel_prep.py: nothing is done off CUDA; on a GPU the build is watched (its
compiles counted, Triton's hook put back after) and autotuning is kept on disk unless
the user chose otherwise; a GPU the table lacks builds as before."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import triton

from batchgen.engine import kernel_prep


def test_nothing_is_prepared_off_cuda(tmp_path):
    hook = triton.knobs.runtime.jit_post_compile_hook
    with kernel_prep.kernels_prepared(torch.device("cpu"), True, tmp_path / "t.json") as watch:
        assert watch is None
        assert triton.knobs.runtime.jit_post_compile_hook is hook
    assert not (tmp_path / "t.json").exists()


@pytest.mark.gpu
def test_a_gpu_build_is_watched_and_keeps_autotuning_on_disk(tmp_path, caplog):
    hook = triton.knobs.runtime.jit_post_compile_hook
    device = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger=kernel_prep.__name__):
        with kernel_prep.kernels_prepared(device, False, tmp_path / "none.json") as watch:
            assert triton.knobs.runtime.jit_post_compile_hook == watch.hook
    assert triton.knobs.runtime.jit_post_compile_hook is hook
    if "TRITON_CACHE_AUTOTUNING" not in os.environ:
        assert triton.knobs.autotuning.cache
    assert any("none recorded for this GPU" in r.getMessage() for r in caplog.records)


def test_the_expected_compiles_count_each_listed_specialization():
    section = {"compile": {"m:a": [{}, {}], "m:b": [{}], "m:c": "not a list"}}
    assert kernel_prep.recorded_compiles(section) == 3
    assert kernel_prep.recorded_compiles({"compile": ["x"]}) == 0
    assert kernel_prep.recorded_compiles({}) == 0
