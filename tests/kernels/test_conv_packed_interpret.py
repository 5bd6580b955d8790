"""The packed short convolution kernel (kernels/conv_packed.py) against the convolution
written out in float64, request by request, and against the torch code of a step with a
prefill (kda_torch.short_conv_packed): outputs within rounding, windows moved on bit for
bit (requests shorter than the window keep part of it), the slots not in the step
untouched, and q, k and v contiguous.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it);
with CUDA the same cases run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.conv_packed import conv_packed
from batchgen.layers import kda_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SLOTS = 24


def _case(lengths, channels, taps, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    wide = torch.randn(rows, channels + 5, generator=gen)
    x = wide.to(DEVICE, dtype)[:, 2 : 2 + channels]  # rows strided, as a projection's slice
    weight = (0.5 * torch.randn(channels, taps, generator=gen)).to(DEVICE, dtype)
    windows = torch.randn(SLOTS, taps - 1, channels, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(SLOTS, generator=gen)[: len(lengths)].to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    return x, weight, windows, cu, slots


def _float64_conv(x, weight, windows, cu, slots):
    """Per request: ext = window ++ rows, tap j of row p reads ext[p + j]; the new window
    is ext's last K - 1 rows."""
    taps = weight.shape[1]
    outs, new = [], {}
    for s, slot in enumerate(slots.tolist()):
        rows = x[cu[s] : cu[s + 1]].double()
        ext = torch.cat([windows[slot].double(), rows])
        for p in range(rows.shape[0]):
            outs.append((ext[p : p + taps] * weight.double().T).sum(0))
        new[slot] = ext[-(taps - 1) :]
    return torch.nn.functional.silu(torch.stack(outs)), new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths,channels,taps,parts",
    [
        ([5, 1, 37, 2], 96, 4, 3),  # a decode row and a short request among prefills
        ([40], 300, 4, 3),  # one request over several row blocks, a ragged channel block
        ([1, 1, 3], 40, 2, 1),  # a one-row window
        ([2, 17], 130, 3, 2),
        ([1] * 12 + [45] + [1] * 7, 64, 4, 1),  # one long prompt among one-row requests
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_conv_packed_matches_the_convolution(dtype, lengths, channels, taps, parts, index_dtype):
    x, weight, windows, cu, slots = _case(lengths, channels, taps, dtype)
    want, want_windows = _float64_conv(x, weight, windows, cu, slots)
    before = windows.clone()
    got = conv_packed(x, weight, windows, cu.to(index_dtype), slots.to(index_dtype), parts)
    assert len(got) == parts
    assert all(t.is_contiguous() and t.shape == (sum(lengths), channels // parts) for t in got)
    out = torch.cat(got, dim=-1)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for slot, rows in want_windows.items():  # moved on by exactly the rows each received
        assert torch.equal(windows[slot].double(), rows)
    others = torch.ones(SLOTS, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(windows[others], before[others])


@pytest.mark.parametrize("launch", [(4, 32, 1), (64, 128, 8), (32, 512, 4)])
def test_every_launch_gives_the_default_launchs_bits(launch):
    """The launch the bench sweeps (rows and channels a program, warps) changes which
    program computes a row, not its numbers; the windows move on alike."""
    x, weight, windows, cu, slots = _case([5, 1, 70, 2], 3 * 100, 4, torch.bfloat16, seed=7)
    other = windows.clone()
    want = torch.cat(conv_packed(x, weight, windows, cu, slots, 3), dim=-1)
    got = torch.cat(conv_packed(x, weight, other, cu, slots, 3, launch=launch), dim=-1)
    assert torch.equal(got, want)
    assert torch.equal(other, windows)


def test_conv_packed_matches_the_torch_packed_step_in_float32():
    x, weight, windows, cu, slots = _case([7, 1, 2, 20], 3 * 32, 4, torch.float32, seed=3)
    torch_windows = windows.clone()
    want = kda_torch.short_conv_packed(x, weight, torch_windows, cu, slots)
    got = torch.cat(conv_packed(x, weight, windows, cu, slots, 3), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(windows, torch_windows)


def test_a_request_split_across_two_steps_gives_the_whole_request():
    """Chunked prefill: the second step reads the window the first left. Both halves
    through the kernel equal the whole request through it in one step (small row and
    channel blocks, so each half spans several of each)."""
    small = (4, 16, 4)
    x, weight, windows, cu, slots = _case([13], 48, 4, torch.float32, seed=5)
    x = x.contiguous()
    whole_windows = windows.clone()
    whole = torch.cat(conv_packed(x, weight, whole_windows, cu, slots, launch=small), dim=-1)
    parts = []
    for lo, hi in ((0, 6), (6, 13)):
        cu_part = torch.tensor([0, hi - lo], device=DEVICE)
        parts.append(conv_packed(x[lo:hi], weight, windows, cu_part, slots, launch=small)[0])
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(windows, whole_windows)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(x=a["x"][:, :, None]), "x must be"),
        (lambda a: a.update(weight=a["weight"][:5]), "weight must be"),
        (lambda a: a.update(windows=a["windows"][:, :1]), "windows must be"),
        (lambda a: a.update(cu=a["cu"][:-1]), r"cu_seqlens \[N \+ 1\]"),
        (lambda a: a.update(slots=a["slots"].float()), "slots must be int32/int64"),
        (lambda a: a.update(parts=5), "does not divide"),
        (lambda a: a.update(rows=a["cu"][:2]), r"rows must be \[5\]"),
    ],
)
def test_bad_arguments_name_what_is_wrong(change, match):
    x, weight, windows, cu, slots = _case([3, 2], 24, 4, torch.float32)
    args = dict(x=x, weight=weight, windows=windows, cu=cu, slots=slots, parts=3, rows=None)
    change(args)
    with pytest.raises(ValueError, match=match):
        conv_packed(
            args["x"], args["weight"], args["windows"], args["cu"], args["slots"],
            args["parts"], args["rows"],
        )  # fmt: skip
