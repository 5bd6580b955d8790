"""MaskStaging: the rows a step fills are the rows the device gets, step after step,
through one reused host buffer (pinned on CUDA) and one device buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.runner.mask_staging import MaskStaging


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_upload_is_the_rows_just_filled(device):
    staging = MaskStaging(torch.device(device), words=7, capacity=4)
    rng = np.random.default_rng(0)
    for n in (3, 4, 1, 6, 2):  # 6 outgrows the buffer
        rows = staging.rows(n)
        assert rows.shape[0] >= n and rows.shape[1] == 7 and rows.dtype == np.int32
        want = rng.integers(-(2**31), 2**31, size=(n, 7), dtype=np.int32)
        rows[:n] = want
        got = staging.upload(n)
        assert got.device.type == device and got.shape == (n, 7)
        assert np.array_equal(got.cpu().numpy(), want)
    kept = staging.rows(6).ctypes.data
    assert staging.rows(2).ctypes.data == kept  # grown once, then reused
