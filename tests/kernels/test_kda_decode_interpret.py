"""The KDA decode step kernel (kernels/kda_decode.py) against the torch decode step
(kda_torch.kda_recurrent with kda_torch.kda_gate and beta's sigmoid): outputs within
rounding, the step's slots left holding the new states, every other slot untouched bit
for bit, at several launch tunings (a short last group of pairs among them); on CUDA with
fla-core also against fla's fused_recurrent_kda_fwd, which the engine ran before it.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets it);
with CUDA the same cases run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.kda_decode import KDADecodeTuning, kda_decode
from batchgen.layers import kda_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPARE = 4  # slots beyond the step's rows, never touched

TUNINGS = [
    KDADecodeTuning(),
    KDADecodeTuning(block_v=8, heads_per_program=2, num_stages=2),
    KDADecodeTuning(block_v=16, num_warps=2, heads_per_program=3),
]


def _case(rows, heads, kdim, vdim, dtype, seed=0, strided=False):
    """The step's inputs as the layer hands them over: q, k, v (strided views of one
    tensor when `strided`, as the projection's slices), f, b, the gate's parameters and
    the pool's states [S, H, V, K] with the step's slots a random subset of them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=dtype):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)

    if strided:  # sliced on the device (a copy there would be contiguous)
        qk = randn(rows, heads, 2 * kdim + 3)
        q, k = qk[..., :kdim], qk[..., kdim + 1 : 2 * kdim + 1]
        v = randn(rows, heads + 1, vdim)[:, 1:]
    else:
        q, k, v = randn(rows, heads, kdim), randn(rows, heads, kdim), randn(rows, heads, vdim)
    f, b = randn(rows, heads, kdim), randn(rows, heads)
    fp32 = torch.float32
    a_log, dt_bias = randn(heads, scale=0.5, dtype=fp32), randn(heads * kdim, dtype=fp32)
    states = randn(rows + SPARE, heads, vdim, kdim, scale=0.3, dtype=fp32)
    slots = torch.randperm(rows + SPARE, generator=gen)[:rows].to(DEVICE)
    return q, k, v, f, b, a_log, dt_bias, states, slots


def _reference(q, k, v, f, b, a_log, dt_bias, states, slots):
    """kda_torch's decode step in float32 on the inputs as given (bfloat16 ones widened
    exactly) -> (o float32 [N, H, V], new states [N, H, V, K])."""
    g = kda_torch.kda_gate(f, a_log, dt_bias)
    past = states[slots].transpose(-1, -2)  # the math's [N, H, K, V]
    o, new = kda_torch.kda_recurrent(
        q.float(), k.float(), v.float(), g, torch.sigmoid(b.float()), past
    )
    return o, new.transpose(-1, -2)


def _untouched(states, before, slots):
    others = torch.ones(states.shape[0], dtype=torch.bool, device=states.device)
    others[slots] = False
    return torch.equal(states[others], before[others])


@pytest.mark.parametrize("tuning", TUNINGS, ids=["default", "bv8-hp2-st2", "bv16-w2-hp3"])
@pytest.mark.parametrize("rows,heads,kdim,vdim", [(5, 3, 16, 16), (4, 2, 32, 16), (5, 2, 24, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kda_decode_matches_the_torch_step(tuning, rows, heads, kdim, vdim, dtype, slot_dtype):
    args = _case(rows, heads, kdim, vdim, dtype, seed=rows * kdim + vdim)
    q, k, v, f, b, a_log, dt_bias, states, slots = args
    want_o, want_s = _reference(*args)
    before = states.clone()
    o = kda_decode(q, k, v, f, b, a_log, dt_bias, states, slots.to(slot_dtype), tuning=tuning)
    assert o.dtype == dtype and o.shape == (rows, heads, vdim) and o.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slots], want_s, rtol=1e-5, atol=1e-5)
    else:  # the same float32 math on the rounded inputs; the output rounded once
        torch.testing.assert_close(o.float(), want_o, rtol=2**-7, atol=1e-4)
        torch.testing.assert_close(states[slots], want_s, rtol=1e-4, atol=1e-4)
    assert _untouched(states, before, slots)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_strided_rows_a_given_scale_and_out(slot_dtype):
    """q, k, v as strided views (a projection's slices), a scale other than K^-0.5 and an
    `out` to write into."""
    args = _case(6, 2, 32, 32, torch.float32, seed=7, strided=True)
    q, k, v, f, b, a_log, dt_bias, states, slots = args
    assert not q.is_contiguous() and not v.is_contiguous()
    before = states.clone()
    g = kda_torch.kda_gate(f, a_log, dt_bias)
    past = states[slots].transpose(-1, -2)
    want_o, want_s = kda_torch.kda_recurrent(q, k, v, g, torch.sigmoid(b), past)
    want_o = 0.5 * want_o  # kda_recurrent's scale is K^-0.5, o is linear in it
    out = torch.full((6, 2, 32), float("nan"), device=DEVICE)
    got = kda_decode(
        q, k, v, f, b, a_log, dt_bias, states, slots.to(slot_dtype), scale=0.5 * 32**-0.5,
        tuning=TUNINGS[1], out=out,
    )  # fmt: skip
    assert got is out
    torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots], want_s.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    assert _untouched(states, before, slots)


def test_two_steps_chain_through_the_states():
    """A second step reads the states the first wrote: two kernel steps give what two
    torch steps give."""
    first = _case(3, 2, 16, 16, torch.float32, seed=11)
    second = _case(3, 2, 16, 16, torch.float32, seed=12)
    states, slots = first[7], first[8]
    ref = states.clone()
    for step in (first, second):
        q, k, v, f, b = step[:5]
        want_o, want_s = _reference(q, k, v, f, b, first[5], first[6], ref, slots)
        ref[slots] = want_s
        got = kda_decode(q, k, v, f, b, first[5], first[6], states, slots, tuning=TUNINGS[2])
        torch.testing.assert_close(got, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref, rtol=1e-5, atol=1e-5)


def test_no_rows_is_no_work():
    q, k, v, f, b, a_log, dt_bias, states, slots = _case(0, 2, 16, 16, torch.float32)
    before = states.clone()
    o = kda_decode(q, k, v, f, b, a_log, dt_bias, states, slots)
    assert o.shape == (0, 2, 16)
    assert torch.equal(states, before)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(states=a["states"].to(torch.bfloat16)), "states must be"),
        (lambda a: a.update(states=a["states"][:, :, :8]), "states must be"),
        (lambda a: a.update(states=a["states"].transpose(-1, -2)), "states must be"),
        (lambda a: a.update(k=a["k"][:, :, :8]), "k must be"),
        (lambda a: a.update(f=a["f"][:2]), "f must be"),
        (lambda a: a.update(v=a["v"][:2]), "v must be"),
        (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "q must be"),
        (lambda a: a.update(b=a["b"][:, :1]), "b must be"),
        (lambda a: a.update(a_log=a["a_log"][:1]), "a_log must"),
        (lambda a: a.update(dt_bias=a["dt_bias"].double()), "dt_bias must be"),
        (lambda a: a.update(slots=a["slots"][:2]), "slots must be"),
        (lambda a: a.update(slots=a["slots"].float()), "slots must be"),
        (lambda a: a.update(out=torch.empty(3, 2, 16, device=DEVICE)), "out must be"),
        (lambda a: a.update(tuning=KDADecodeTuning(block_v=24)), "tuning"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, match):
    names = ("q", "k", "v", "f", "b", "a_log", "dt_bias", "states", "slots")
    args = dict(zip(names, _case(4, 2, 16, 16, torch.float32)))
    args["states"] = args["states"].clone()
    change(args)
    with pytest.raises(ValueError, match=match):
        kda_decode(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tuning", TUNINGS + [KDADecodeTuning(64, 8, 4, 3)], ids=str)
def test_matches_fla_fused_recurrent_kda(tuning):
    """W6's geometry (16 heads of 128, bfloat16 inputs): the same outputs and new states
    as fla-core's recurrent step, called as layers/kda_ops.py calls it."""
    from fla.ops.kda import fused_recurrent as fla

    rows, heads, dim = 48, 16, 128
    args = _case(rows, heads, dim, dim, torch.bfloat16, seed=3)
    q, k, v, f, b, a_log, dt_bias, states, slots = args
    fla_states = states.clone()
    want, _ = fla.fused_recurrent_kda_fwd(
        *(x.unsqueeze(0) for x in (q, k, v, f, b)),
        A_log=a_log, dt_bias=dt_bias, initial_state=fla_states, scale=dim**-0.5,
        inplace_final_state=True, cu_seqlens=torch.arange(rows + 1, device=DEVICE),
        ssm_state_indices=slots, state_v_first=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip
    got = kda_decode(q, k, v, f, b, a_log, dt_bias, states, slots, tuning=tuning)
    torch.testing.assert_close(got.float(), want[0].float(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(states, fla_states, rtol=1e-4, atol=1e-4)
