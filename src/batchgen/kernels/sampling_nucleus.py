"""Top-p sampling without the nucleus cut: draw first, then check the draw.

`sampling.sample_tokens` draws argmax(x / T + Gumbel) over the tokens a row keeps; with
top-p it needs the nucleus {x >= v} first (`top_p_cut_reference` below sorts the row
for it; a kernel would take several passes over the row). Here the draw comes first, over all the tokens kept before top-p (x >= cut): the
drawn token y is in the nucleus iff the mass of the tokens above it is short of p,
mass({x > x_y}) < p * Z, and then it is also the argmax over the nucleus, so it is the
draw `sample_tokens(..., cut=nucleus)` makes, with the same noise. Otherwise every token
at or below x_y is outside the nucleus, which lies in {x > x_y}: the row draws again over
that set and checks again, until a draw lands in it (the top token always does). A draw
lands in the nucleus with probability >= p, so a row is settled by the first check
(p = 0.95: 19 rows in 20); the others take two more passes per try.

Three launches, none read back: the draw over chunks of the vocabulary, which also notes
each chunk's largest kept logit (`sampling._sample_kernel`); per chunk, the row's mass Z
and the mass above the drawn token; per row, the check and, where it fails, the tries
over the whole row. Greedy rows and rows with p >= 1 keep their first draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.sampling import (
    _BLOCK,
    _CHUNK_BLOCKS,
    _check,
    _gumbel,
    _row_keys,
    _sample_kernel,
)

_ROW_BLOCK = 4096  # a retrying row has an SM to itself: 32 warps keep its passes busy


@triton.jit
def _row_draw(best_ptr, index_ptr, max_ptr, row, NUM_CHUNKS, NC: tl.constexpr):
    """The row's first draw (the first chunk holding the best score wins, as torch's
    argmax) and its largest kept logit."""
    c = tl.arange(0, NC)
    inside = c < NUM_CHUNKS
    best = tl.load(best_ptr + row * NUM_CHUNKS + c, mask=inside, other=float("-inf"))
    top_best = tl.max(best, axis=0)
    first = tl.min(tl.where((best == top_best) & inside, c, NC), axis=0)
    top = tl.max(tl.load(max_ptr + row * NUM_CHUNKS + c, mask=inside, other=float("-inf")), axis=0)
    return tl.load(index_ptr + row * NUM_CHUNKS + first), top


@triton.jit
def _mass_kernel(
    logits_ptr, temperature_ptr, top_p_ptr, cut_ptr, best_ptr, index_ptr, max_ptr,
    z_ptr, above_ptr, stride_row, VOCAB, NUM_CHUNKS,
    HAS_CUT: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
):  # fmt: skip
    """Per chunk: the kept tokens' mass exp((x - top) / T), all of it and above the draw."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    p = tl.load(top_p_ptr + row)
    z_sum = t * 0.0
    above_sum = t * 0.0
    if (p < 1.0) & (t > 0.0):
        inv_t = 1.0 / t
        cut = float("-inf")
        if HAS_CUT:
            cut = tl.load(cut_ptr + row)
        y, top = _row_draw(best_ptr, index_ptr, max_ptr, row, NUM_CHUNKS, NC)
        x_y = tl.load(logits_ptr + row * stride_row + y).to(tl.float32)
        z = tl.zeros([BLOCK], dtype=tl.float32)
        above = tl.zeros([BLOCK], dtype=tl.float32)
        start = chunk * BLOCK * CHUNK_BLOCKS
        for b in range(CHUNK_BLOCKS):
            cols = start + b * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < VOCAB,
                        other=float("-inf")).to(tl.float32)  # fmt: skip
            w = tl.where(x >= cut, tl.exp((x - top) * inv_t), 0.0)
            z += w
            above += tl.where(x > x_y, w, 0.0)
        z_sum = tl.sum(z, axis=0)
        above_sum = tl.sum(above, axis=0)
    tl.store(z_ptr + row * NUM_CHUNKS + chunk, z_sum)
    tl.store(above_ptr + row * NUM_CHUNKS + chunk, above_sum)


@triton.jit
def _nucleus_kernel(
    logits_ptr, temperature_ptr, seed_ptr, position_ptr, top_p_ptr, cut_ptr, best_ptr,
    index_ptr, max_ptr, z_ptr, above_ptr, out_ptr, stride_row, VOCAB, NUM_CHUNKS,
    HAS_CUT: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per row: keep the draw if it is in the nucleus, else draw again above it."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature_ptr + row)
    p = tl.load(top_p_ptr + row)
    y, top = _row_draw(best_ptr, index_ptr, max_ptr, row, NUM_CHUNKS, NC)
    if (p < 1.0) & (t > 0.0):
        c = tl.arange(0, NC)
        inside = c < NUM_CHUNKS
        z = tl.sum(tl.load(z_ptr + row * NUM_CHUNKS + c, mask=inside, other=0.0), axis=0)
        above = tl.sum(tl.load(above_ptr + row * NUM_CHUNKS + c, mask=inside, other=0.0), axis=0)
        target = p * z
        settled = ((above < target) | (z == 0.0)).to(tl.int32)  # z == 0: no token kept
        inv_t = 1.0 / t
        cut = float("-inf")
        if HAS_CUT:
            cut = tl.load(cut_ptr + row)
        key1, key2 = _row_keys(seed_ptr, position_ptr, row)
        floor = tl.load(logits_ptr + row * stride_row + y).to(tl.float32)
        while settled == 0:
            # every token at or below `floor` is outside the nucleus: draw above it
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            best_at = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, VOCAB, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < VOCAB,
                            other=float("-inf")).to(tl.float32)  # fmt: skip
                noisy = x * inv_t + _gumbel(cols, key1, key2)
                score = tl.where((x >= cut) & (x > floor), noisy, float("-inf"))
                better = score > best
                best = tl.where(better, score, best)
                best_at = tl.where(better, cols, best_at)
            top_score = tl.max(best, axis=0)
            y = tl.min(tl.where(best == top_score, best_at, 2147483647), axis=0).to(tl.int64)
            floor = tl.load(logits_ptr + row * stride_row + y).to(tl.float32)
            mass = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, VOCAB, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < VOCAB,
                            other=float("-inf")).to(tl.float32)  # fmt: skip
                w = tl.where(x >= cut, tl.exp((x - top) * inv_t), 0.0)
                mass += tl.where(x > floor, w, 0.0)
            settled = ((tl.sum(mass, axis=0) < target) | (top_score == float("-inf"))).to(tl.int32)
    tl.store(out_ptr + row, y)


def sample_nucleus(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_p: torch.Tensor,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sampling.sample_tokens(logits, temperature, seeds, positions, nucleus)` where
    nucleus is each row's top-p cut of softmax(x / T) over x >= cut (`top_p_cut_reference`),
    without computing that cut: top_p [B] float32 (>= 1: no top-p) -> tokens [B] int64.
    Nothing is read back to the host."""
    _check(logits, temperature, seeds, positions, cut)
    if top_p.shape != temperature.shape or top_p.dtype != torch.float32:
        raise ValueError(f"top_p must be [{logits.shape[0]}] float32: {list(top_p.shape)}")
    rows, vocab = logits.shape
    block = min(_BLOCK, triton.next_power_of_2(max(vocab, 1)))
    chunk_blocks = min(_CHUNK_BLOCKS, triton.cdiv(vocab, block))
    num_chunks = triton.cdiv(vocab, block * chunk_blocks)
    dev = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    if rows == 0:
        return out
    # four allocations, not one [4, rows, chunks] tensor: each must start 16-byte aligned
    # whatever rows is (Triton compiles a kernel once per alignment pattern of its pointers)
    best, top, z, above = (
        torch.empty((rows, num_chunks), dtype=torch.float32, device=dev) for _ in range(4)
    )
    index = torch.empty((rows, num_chunks), dtype=torch.int64, device=dev)
    has_cut, cut_arg = cut is not None, temperature if cut is None else cut
    nc = triton.next_power_of_2(num_chunks)
    _sample_kernel[(rows, num_chunks)](
        logits, temperature, seeds, positions, cut_arg, best, index, top,
        logits.stride(0), vocab, num_chunks, HAS_CUT=has_cut, WITH_MAX=True, BLOCK=block,
        CHUNK_BLOCKS=chunk_blocks, num_warps=4,
    )  # fmt: skip
    _mass_kernel[(rows, num_chunks)](
        logits, temperature, top_p, cut_arg, best, index, top, z, above, logits.stride(0),
        vocab, num_chunks, HAS_CUT=has_cut, NC=nc, BLOCK=block, CHUNK_BLOCKS=chunk_blocks,
        num_warps=4,
    )  # fmt: skip
    _nucleus_kernel[(rows,)](
        logits, temperature, seeds, positions, top_p, cut_arg, best, index, top, z, above,
        out, logits.stride(0), vocab, num_chunks, HAS_CUT=has_cut, NC=nc,
        BLOCK=min(_ROW_BLOCK, triton.next_power_of_2(max(vocab, 1))), num_warps=32,
    )  # fmt: skip
    return out


def _check_cut(logits, temperature, top_p, cut) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be float [B, V] with contiguous rows: {list(logits.shape)}")
    rows = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_p", top_p), ("cut", cut)):
        if t.shape != (rows,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{rows}] float32: {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, the logits on {logits.device}")


def top_p_cut_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, cut: torch.Tensor
) -> torch.Tensor:
    """logits [B, V] (rows contiguous), temperature, top_p and cut [B] float32 -> the new
    cut [B] float32: the nucleus of softmax(x / T) over the tokens with x >= cut, ties at
    its edge included (greedy rows, temperature 0, and rows with top_p >= 1 keep cut), from
    a full sort: the kept tokens in descending order, their softmax(x / T) summed, the
    first token where the sum reaches p gives the cut. The sampler's top-p off CUDA, and
    the cut `sample_nucleus` is checked against."""
    _check_cut(logits, temperature, top_p, cut)
    x = logits.float()
    kept = x.masked_fill(x < cut[:, None], float("-inf"))
    inv_t = 1.0 / torch.where(temperature > 0, temperature, 1.0)
    desc, _ = kept.sort(dim=1, descending=True)
    mass = torch.softmax(desc * inv_t[:, None], dim=1).cumsum(dim=1)
    edge = (mass < top_p[:, None]).sum(dim=1, keepdim=True).clamp(max=x.shape[1] - 1)
    nucleus = desc.gather(1, edge).squeeze(1)
    return torch.where((top_p < 1.0) & (temperature > 0), nucleus, cut)
