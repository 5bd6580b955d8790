"""The decode step's short convolution kernel (kernels/conv_decode.py) against the
convolution written out in float64 and against the torch code of a KDA decode step
(kda_torch.short_conv_decode): outputs within rounding, windows moved on bit for bit,
the slots not in the step untouched.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it);
with CUDA the same cases run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.conv_decode import conv_decode
from batchgen.layers import kda_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SLOTS = 9


def _case(rows, channels, taps, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, channels + 5, generator=gen)
    x = wide.to(DEVICE, dtype)[:, 2 : 2 + channels]  # rows strided, as a projection's slice
    weight = (0.5 * torch.randn(channels, taps, generator=gen)).to(DEVICE, dtype)
    windows = torch.randn(SLOTS, taps - 1, channels, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(SLOTS, generator=gen)[:rows].to(DEVICE)
    return x, weight, windows, slots


def _float64_conv(x, weight, windows, slots):
    ext = torch.cat([windows[slots].double(), x.double().unsqueeze(1)], dim=1)  # [N, K, C]
    out = torch.einsum("nkc,ck->nc", ext, weight.double())
    return torch.nn.functional.silu(out), ext[:, 1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,taps,parts", [(96, 4, 3), (1200, 4, 3), (40, 2, 1), (130, 3, 2)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_conv_decode_matches_the_convolution(dtype, channels, taps, parts, slot_dtype):
    x, weight, windows, slots = _case(6, channels, taps, dtype)
    want, want_rows = _float64_conv(x, weight, windows, slots)
    before = windows.clone()
    got = conv_decode(x, weight, windows, slots.to(slot_dtype), parts)
    assert len(got) == parts
    assert all(t.is_contiguous() and t.shape == (6, channels // parts) for t in got)
    out = torch.cat(got, dim=-1)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    # the windows of the step's slots move on by exactly the row each received
    assert torch.equal(windows[slots].double(), want_rows)
    others = torch.ones(SLOTS, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(windows[others], before[others])


def test_conv_decode_matches_the_torch_decode_step_in_float32():
    x, weight, windows, slots = _case(5, 3 * 64, 4, torch.float32, seed=3)
    torch_windows = windows.clone()
    want = kda_torch.short_conv_decode(x, weight, torch_windows, slots)
    got = torch.cat(conv_decode(x, weight, windows, slots, 3), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(windows, torch_windows)


def test_two_steps_chain_through_the_windows():
    """A second step reads the rows the first wrote: two kernel steps give what two torch
    steps give."""
    x, weight, windows, slots = _case(4, 48, 4, torch.float32, seed=5)
    x2 = torch.randn(4, 48, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    torch_windows = windows.clone()
    for step in (x, x2):
        want = kda_torch.short_conv_decode(step, weight, torch_windows, slots)
        got = torch.cat(conv_decode(step, weight, windows, slots, 1), dim=-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(windows, torch_windows)


def test_no_rows_is_no_work():
    x, weight, windows, slots = _case(0, 48, 4, torch.float32)
    before = windows.clone()
    got = conv_decode(x, weight, windows, slots, 3)
    assert [t.shape for t in got] == [(0, 16)] * 3
    assert torch.equal(windows, before)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(weight=a["weight"][:, :1]), "weight must be"),
        (lambda a: a.update(weight=a["weight"][:10]), "weight must be"),
        (lambda a: a.update(windows=a["windows"][:, :2]), "windows must be"),
        (lambda a: a.update(slots=a["slots"].float()), "slots must be"),
        (lambda a: a.update(slots=a["slots"][:2]), "slots must be"),
        (lambda a: a.update(parts=5), "parts=5"),
        (lambda a: a.update(x=a["x"].t()), "x must be"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, match):
    x, weight, windows, slots = _case(4, 48, 4, torch.float32)
    args = dict(x=x, weight=weight, windows=windows, slots=slots, parts=3)
    change(args)
    with pytest.raises(ValueError, match=match):
        conv_decode(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_has_the_bits_of_the_packed_kernel(dtype):
    """deterministic=True: a decode row's convolution is the same bits in a decode-only
    step (this kernel) as in a mixed step (kernels/conv_packed.py): the taps summed in one
    order."""
    from batchgen.kernels.conv_packed import conv_packed

    x, weight, windows, slots = _case(6, 3 * 96, 4, dtype, seed=7)
    packed_windows = windows.clone()
    cu = torch.arange(7, device=DEVICE)
    want = conv_packed(x, weight, packed_windows, cu, slots, 3)
    got = conv_decode(x, weight, windows, slots, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(windows, packed_windows)
