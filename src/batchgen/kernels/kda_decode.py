"""One decode step of Kimi Delta Attention (KDA) over slot-held recurrent states, in
place: one Triton program per (group of `heads_per_program` (request, head) pairs, block
of `block_v` value rows).

Per request n and head h, with s = states[slots[n], h] ([V, K], value-major) and q, k
L2-normalised (q also scaled, by K^-0.5 unless told),

    g = -exp(a_log[h]) * softplus(f[n, h] + dt_bias[h])      per key dim, float32
    s <- s * exp(g)[None, :]
    u = sigmoid(b[n, h]) * (v[n, h] - s @ k)                   [V]
    s <- s + u[:, None] * k[None, :]
    o[n, h] = s @ q                                            [V], in v's dtype

and states[slots[n], h] <- s. This is kda_torch.kda_recurrent with the gate
(kda_torch.kda_gate) and beta's sigmoid taken from the raw f and b projections, the state
held transposed (kda_torch's S is [K, V]): the layout layers/kda_ops.py keeps, each value
row's K keys contiguous, so that s @ k and s @ q are sums along a row.

The step is memory-bound: every request's float32 state is read and written once (W6's
512 rows of 16 heads of 128 x 128 move 1.07 GB a layer), q, k, v, f and b are noise
beside it. fla-core's fused_recurrent_kda_fwd, which the engine ran before, takes one
32-row block per program with 4 warps and reaches about 74% of the H200's copy rate;
this kernel computes the same numbers with launch parameters to sweep (KDADecodeTuning,
benchmarks/bench_kernels.py --kda), the fastest measured the default. A program holds
a [block_v, K] tile (K is one block, its next power of two, masked); with
heads_per_program > 1 it walks that many
consecutive (request, head) pairs in a `tl.range` loop of `num_stages` stages, so that
the next pair's state load is in flight while this pair's sums and stores run (software
pipelining); the last group may be short, its missing pairs masked. On an H200 (bench
--kda, 512 rows, bfloat16 inputs): fla 343 us (74% of copy); this kernel 302 us (84%)
with the default launch, 292 to 305 us with 16 to 64 rows and 1 to 8 warps (64 rows and
2 warps the fastest), 310 to 384 us with 2 or 4 pairs a program, pipelined or not.

Slots must be >= 0 and distinct among the step's rows (each state is read and written by
the programs of its own row only); padded rows of a captured graph may share one spare
slot, whose state is then undefined. Nothing is read back to the host: capturable.
Softplus is log(1 + exp(x)), x itself above 20 (torch's threshold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import rne_by_hand, to_dtype

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KDADecodeTuning:
    """Launch parameters: a program covers block_v value rows of heads_per_program
    consecutive (request, head) pairs, walked in a loop of num_stages pipeline stages."""

    block_v: int = 64
    num_warps: int = 2
    heads_per_program: int = 1
    num_stages: int = 1


TUNING = KDADecodeTuning()


@triton.jit(do_not_specialize=["num_pairs"])
def _kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, o_ptr,
    num_pairs, scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_fn, stride_fh,
    stride_bn, stride_bh, stride_on, stride_oh, stride_ss, stride_sh,
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, PAIRS: tl.constexpr, STAGES: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0).to(tl.int64) * PAIRS
    rows = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    mask_k = cols < K
    mask_v = rows < V
    tile = rows[:, None] * K + cols[None, :]
    for i in tl.range(0, PAIRS, num_stages=STAGES):
        pair = first + i
        live = pair < num_pairs
        n = pair // HEADS
        h = pair % HEADS
        slot = tl.load(slot_ptr + n, mask=live, other=0).to(tl.int64)
        s_at = state_ptr + slot * stride_ss + h * stride_sh + tile
        # a scalar mask is folded in with where(), not `&`: triton 3.9's interpreter
        # broadcasts a scalar int1 to int32, which tl.load refuses as a mask
        mask_kl = tl.where(live, mask_k, False)
        mask_vl = tl.where(live, mask_v, False)
        mask_s = mask_vl[:, None] & mask_k[None, :]
        s = tl.load(s_at, mask=mask_s, other=0.0)
        q = tl.load(q_ptr + n * stride_qn + h * stride_qh + cols, mask=mask_kl, other=0.0)
        key = tl.load(k_ptr + n * stride_kn + h * stride_kh + cols, mask=mask_kl, other=0.0)
        f = tl.load(f_ptr + n * stride_fn + h * stride_fh + cols, mask=mask_kl, other=0.0)
        v = tl.load(v_ptr + n * stride_vn + h * stride_vh + rows, mask=mask_vl, other=0.0)
        b = tl.load(b_ptr + n * stride_bn + h * stride_bh, mask=live, other=0.0).to(tl.float32)
        a_log = tl.load(a_log_ptr + h, mask=live, other=0.0)
        bias = tl.load(dt_bias_ptr + h * K + cols, mask=mask_kl, other=0.0)

        q = q.to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        key = key.to(tl.float32)
        key = key / tl.sqrt(tl.sum(key * key) + 1e-6)
        x = f.to(tl.float32) + bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        decay = tl.exp(-tl.exp(a_log) * softplus)

        s = s * decay[None, :]
        predicted = tl.sum(s * key[None, :], axis=1)
        u = tl.sigmoid(b) * (v.to(tl.float32) - predicted)
        s = s + u[:, None] * key[None, :]
        o = tl.sum(s * q[None, :], axis=1)
        tl.store(s_at, s, mask=mask_s)
        o_at = o_ptr + n * stride_on + h * stride_oh + rows
        tl.store(o_at, to_dtype(o, o_ptr.dtype.element_ty, RNE_BY_HAND), mask=mask_vl)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype not in _DTYPES:
        raise ValueError(
            f"{name} must be {list(shape)} float32/bfloat16/float16: {list(t.shape)} {t.dtype}"
        )
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim: {t.stride()}")


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    tuning: KDADecodeTuning = TUNING,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k, f [N, H, K] and v [N, H, V] (any float dtype, rows may be strided, each
    contiguous), b [N, H] the raw beta projection, a_log (H elements) and dt_bias [H * K]
    float32, states [S, H, V, K] float32 contiguous (the slots' states written in place),
    slots [N] int32/int64 (>= 0, distinct) -> o [N, H, V] in v's dtype (into `out` when
    given). scale None: K^-0.5."""
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, K]: {list(q.shape)}")
    rows, heads, kdim = q.shape
    _check_rows("q", q, (rows, heads, kdim))
    _check_rows("k", k, (rows, heads, kdim))
    _check_rows("f", f, (rows, heads, kdim))
    if v.dim() != 3:
        raise ValueError(f"v must be [{rows}, {heads}, V]: {list(v.shape)}")
    vdim = v.shape[2]
    _check_rows("v", v, (rows, heads, vdim))
    if tuple(b.shape) != (rows, heads) or b.dtype not in _DTYPES:
        raise ValueError(f"b must be [{rows}, {heads}] float: {list(b.shape)} {b.dtype}")
    if a_log.numel() != heads or a_log.dtype != torch.float32 or not a_log.is_contiguous():
        raise ValueError(
            f"a_log must hold {heads} float32 values, contiguous: {list(a_log.shape)} {a_log.dtype}"
        )
    if tuple(dt_bias.shape) != (heads * kdim,) or dt_bias.dtype != torch.float32:
        raise ValueError(
            f"dt_bias must be [{heads * kdim}] float32: {list(dt_bias.shape)} {dt_bias.dtype}"
        )
    if dt_bias.stride(0) != 1:
        raise ValueError(f"dt_bias must be contiguous: {dt_bias.stride()}")
    if (
        states.dim() != 4
        or tuple(states.shape[1:]) != (heads, vdim, kdim)
        or states.dtype != torch.float32
    ):
        raise ValueError(
            f"states must be [S, {heads}, {vdim}, {kdim}] float32: "
            f"{list(states.shape)} {states.dtype}"
        )
    if not states.is_contiguous():
        raise ValueError(f"states must be contiguous: {states.stride()}")
    if tuple(slots.shape) != (rows,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be [{rows}] int32/int64: {list(slots.shape)} {slots.dtype}")
    if out is None:
        out = torch.empty((rows, heads, vdim), dtype=v.dtype, device=v.device)
    elif tuple(out.shape) != (rows, heads, vdim) or out.dtype != v.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be [{rows}, {heads}, {vdim}] {v.dtype}, contiguous along V: "
            f"{list(out.shape)} {out.dtype} {out.stride()}"
        )
    tensors = (q, k, v, f, b, a_log, dt_bias, states, slots, out)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(
            "q, k, v, f, b, a_log, dt_bias, states, slots and out must be on one device"
        )
    t = tuning
    if t.block_v < 1 or t.block_v & (t.block_v - 1) or t.heads_per_program < 1:
        raise ValueError(f"tuning needs a power-of-two block_v and heads_per_program >= 1: {t}")
    pairs = rows * heads
    if pairs == 0:
        return out
    grid = (triton.cdiv(pairs, t.heads_per_program), triton.cdiv(vdim, t.block_v))
    _kda_decode_kernel[grid](
        q, k, v, f, b, a_log, dt_bias, states, slots, out,
        pairs, kdim**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        f.stride(0), f.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1),
        HEADS=heads, K=kdim, V=vdim, BLOCK_K=triton.next_power_of_2(kdim), BLOCK_V=t.block_v,
        PAIRS=t.heads_per_program, STAGES=t.num_stages, RNE_BY_HAND=rne_by_hand(out),
        num_warps=t.num_warps,
    )  # fmt: skip
    return out
