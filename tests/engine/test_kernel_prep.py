"""engine/kernel_prep.py: nothing is done off CUDA; on a GPU the build is watched (its
compiles counted, Triton's hook put back after) and autotuning is kept on disk for the
build unless the user chose otherwise (the setting put back after); a GPU the table
lacks builds as before."""

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
    """While the build runs, its compiles are watched and autotuning is kept on disk
    (unless the user chose); after it, Triton's hook and autotune setting (the knob and
    its environment variable) are what they were before."""
    hook = triton.knobs.runtime.jit_post_compile_hook
    setting = triton.knobs.autotuning.cache, os.environ.get("TRITON_CACHE_AUTOTUNING")
    device = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger=kernel_prep.__name__):
        with kernel_prep.kernels_prepared(device, False, tmp_path / "none.json") as watch:
            assert triton.knobs.runtime.jit_post_compile_hook == watch.hook
            if setting[1] is None:
                assert triton.knobs.autotuning.cache
    assert triton.knobs.runtime.jit_post_compile_hook is hook
    assert (triton.knobs.autotuning.cache, os.environ.get("TRITON_CACHE_AUTOTUNING")) == setting
    assert any("none recorded for this GPU" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_a_worker_ranks_build_logs_no_compiles_and_restores_autotuning():
    hook = triton.knobs.runtime.jit_post_compile_hook
    setting = triton.knobs.autotuning.cache, os.environ.get("TRITON_CACHE_AUTOTUNING")
    with kernel_prep.kernels_prepared(torch.device("cuda"), False, log_compiles=False) as watch:
        assert watch is None and triton.knobs.runtime.jit_post_compile_hook is hook
    assert (triton.knobs.autotuning.cache, os.environ.get("TRITON_CACHE_AUTOTUNING")) == setting


def test_the_expected_compiles_count_each_listed_specialization():
    section = {"compile": {"m:a": [{}, {}], "m:b": [{}], "m:c": "not a list"}}
    assert kernel_prep.recorded_compiles(section) == 3
    assert kernel_prep.recorded_compiles({"compile": ["x"]}) == 0
    assert kernel_prep.recorded_compiles({}) == 0
