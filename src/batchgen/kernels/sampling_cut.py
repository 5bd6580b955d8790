"""The nucleus (top-p) cut of each row, without sorting the vocabulary.

Over the tokens a row still keeps (logit x >= cut, after min_p and top_k), with
probabilities softmax(x / T), the nucleus is the smallest set of the most likely tokens
whose mass reaches p; tokens tied with its least likely one are kept too. It is
{x >= v} for v the largest logit with mass({x >= v}) >= p, so the kernel returns v as
the row's new cut and `sampling.sample_tokens` keeps x >= v.

v is found over the logits' order-preserving int32 keys (a float's bits, the magnitude
bits flipped for negatives): mass({key >= t}) does not grow with t, so a search pins
the largest admissible key exactly. Each pass over the row tests 16 keys spread over
the interval still open ([BLOCK, 16] comparisons, one exp a token) and keeps the gap
where the mass crosses p: 17-fold narrower a pass, so at most 8 such passes after the
one that finds the top (the bisection this replaces made ~33). The interval starts at [top + T log((1 - p) / 2V),
top] (tokens below that floor weigh too little together to hold the cut), checked on
the first pass. One program per row (32 warps: at W1's ~100-250 rows, one per SM, the
passes are latency-bound); a greedy row, or one with p >= 1, keeps its cut.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048
_THRESHOLDS = 16  # keys tested a pass: each pass narrows the search 17-fold


@triton.jit
def _key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _masses(logits_ptr, row, stride_row, VOCAB, cut, top, inv_t, lo, hi,
            BLOCK: tl.constexpr, K: tl.constexpr):  # fmt: skip
    """One pass over the row: with w = exp((x - top) / T) over the kept tokens (x >= cut),
    the sum of all w, of those with key >= lo, and of those with key >= t_j for the K
    keys t_j spread evenly over [lo, hi) (returned too, ascending)."""
    j = tl.arange(0, K).to(tl.int64)
    th = (lo + ((j + 1) * (hi - lo)) // (K + 1)).to(tl.int32)
    lo32 = lo.to(tl.int32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    from_lo = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, K], dtype=tl.float32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < VOCAB, other=float("-inf"))
        x = x.to(tl.float32)
        w = tl.where(x >= cut, tl.exp((x - top) * inv_t), 0.0)
        key = _key(x)
        total += w
        from_lo += tl.where(key >= lo32, w, 0.0)
        acc += tl.where(key[:, None] >= th[None, :], w[:, None], 0.0)
    return tl.sum(total, axis=0), tl.sum(from_lo, axis=0), tl.sum(acc, axis=0), th.to(tl.int64)


@triton.jit
def _top_p_cut_kernel(
    logits_ptr, temperature_ptr, top_p_ptr, cut_ptr, out_ptr, stride_row, VOCAB,
    BLOCK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature_ptr + row)
    p = tl.load(top_p_ptr + row)
    cut = tl.load(cut_ptr + row)
    result = cut
    if (p < 1.0) & (t > 0.0):
        inv_t = 1.0 / t
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        low = tl.full([BLOCK], 2147483647, tl.int32)
        for start in range(0, VOCAB, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < VOCAB,
                        other=float("-inf")).to(tl.float32)  # fmt: skip
            keep = x >= cut
            top = tl.maximum(top, tl.where(keep, x, float("-inf")))
            low = tl.minimum(low, tl.where(keep, _key(x), 2147483647))
        top_x = tl.max(top, axis=0)
        lowest = tl.min(low, axis=0).to(tl.int64)  # mass from here: all of it
        hi = _key(top_x).to(tl.int64) + 1  # mass from here: none
        # A token below top + T log((1 - p) / V) weighs under (1 - p) / V of the top one,
        # so all of them together weigh under (1 - p) of the row (the top weighs 1 of
        # its mass Z >= 1): the cut is at or above that floor (half of it, for rounding;
        # the first pass checks its mass and falls back to the lowest kept key).
        floor = top_x + t * tl.log(0.5 * (1.0 - p) / VOCAB)
        floor = tl.where(floor == floor, floor, float("-inf"))
        lo = tl.maximum(lowest, _key(floor).to(tl.int64))
        total, from_lo, mass, th = _masses(logits_ptr, row, stride_row, VOCAB, cut, top_x,
                                           inv_t, lo, hi, BLOCK, K)  # fmt: skip
        target = p * total
        reach = mass >= target
        ok = from_lo >= target
        new_lo = tl.max(tl.where(reach, th, lo), axis=0)
        new_hi = tl.min(tl.where(reach, hi, th), axis=0)
        hi = tl.where(ok, new_hi, lo)
        lo = tl.where(ok, new_lo, lowest)
        # invariant: mass(key >= lo) >= target > mass(key >= hi); the largest such lo
        # is the cut's key
        while hi - lo > 1:
            _, _, mass, th = _masses(logits_ptr, row, stride_row, VOCAB, cut, top_x, inv_t,
                                     lo, hi, BLOCK, K)  # fmt: skip
            reach = mass >= target
            new_lo = tl.max(tl.where(reach, th, lo), axis=0)
            hi = tl.min(tl.where(reach, hi, th), axis=0)
            lo = new_lo
        bits = lo.to(tl.int32)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        result = bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + row, result)


def _check(logits, temperature, top_p, cut) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be float [B, V] with contiguous rows: {list(logits.shape)}")
    rows = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_p", top_p), ("cut", cut)):
        if t.shape != (rows,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{rows}] float32: {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, the logits on {logits.device}")


def top_p_cut(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, cut: torch.Tensor
) -> torch.Tensor:
    """logits [B, V] (rows contiguous), temperature, top_p and cut [B] float32 -> the new
    cut [B] float32: the nucleus of softmax(x / T) over the tokens with x >= cut, ties at
    its edge included (greedy rows, temperature 0, and rows with top_p >= 1 keep cut).
    Nothing is read back to the host."""
    _check(logits, temperature, top_p, cut)
    out = torch.empty_like(cut)
    rows, vocab = logits.shape
    if rows:
        block = min(_BLOCK, triton.next_power_of_2(vocab))
        _top_p_cut_kernel[(rows,)](
            logits, temperature, top_p, cut, out, logits.stride(0), vocab, BLOCK=block,
            K=_THRESHOLDS, num_warps=32,
        )  # fmt: skip
    return out


def top_p_cut_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, cut: torch.Tensor
) -> torch.Tensor:
    """The same cut from a full sort (the sampler's path on the CPU): the kept tokens in
    descending order, their softmax(x / T) summed, the first token where the sum reaches
    p gives the cut."""
    _check(logits, temperature, top_p, cut)
    x = logits.float()
    kept = x.masked_fill(x < cut[:, None], float("-inf"))
    inv_t = 1.0 / torch.where(temperature > 0, temperature, 1.0)
    desc, _ = kept.sort(dim=1, descending=True)
    mass = torch.softmax(desc * inv_t[:, None], dim=1).cumsum(dim=1)
    edge = (mass < top_p[:, None]).sum(dim=1, keepdim=True).clamp(max=x.shape[1] - 1)
    nucleus = desc.gather(1, edge).squeeze(1)
    return torch.where((top_p < 1.0) & (temperature > 0), nucleus, cut)
