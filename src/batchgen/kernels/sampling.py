"""Sampling of a whole batch in one launch: argmax of the logits for greedy rows, and for
sampled rows argmax(x / T + Gumbel) over the tokens a row keeps (x >= its cut), which
is an exact draw from softmax(x / T) renormalised over the kept tokens.

The Gumbel noise is counter-based: token j of a row gets

    key0 = mix(seed)                       per row, from its 64-bit seed
    key1 = hash(key0 ^ position)           position: the row's tokens generated so far
    bits = hash(hash(j ^ key1) ^ hash(key1 ^ SALT))
    u    = (bits >> 8 + 1/2) / 2^24        in (0, 1), 24 random bits
    g    = -log(-log(u))

so a row's draws depend on (seed, position, token) only: never on the batch, the row's
place in it, or a step that was computed and discarded. Nothing random lives on the
host or in a generator; seeds and positions are device tensors, so a captured graph
or a pipelined step reads them like any other input. `hash` is a 32-bit integer
finaliser (xorshift-multiply, two rounds); the reference computes the same bits with
int64 arithmetic (32-bit products split in 16-bit halves, all exact), so the kernel and
the reference pick the same tokens but for float rounding of the log at near ties.

One program takes one row's chunk of the vocabulary and writes its best (score, index);
the chunks' winners are reduced with torch (argmax, then a gather): the first best
index wins ties, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_SALT_SEED = 0x5EED0001
_SALT_KEY = 0x68E31DA4
_MASK32 = 0xFFFFFFFF
_BLOCK = 1024
_CHUNK_BLOCKS = 8  # blocks a program walks: chunks of 8,192 tokens


@triton.jit
def _hash32(x):
    """uint32 -> uint32 bijection with full avalanche (xorshift-multiply)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seed_ptr, position_ptr, row):
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    key0 = _hash32(lo ^ _hash32(hi ^ 0x5EED0001))
    position = tl.load(position_ptr + row).to(tl.uint64, bitcast=True)
    key1 = _hash32(key0 ^ (position & 0xFFFFFFFF).to(tl.uint32))
    key2 = _hash32(key1 ^ 0x68E31DA4)
    return key1, key2


@triton.jit
def _gumbel(cols, key1, key2):
    bits = _hash32(_hash32(cols.to(tl.uint32) ^ key1) ^ key2)
    u = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
    return -tl.log(-tl.log(u))


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, seed_ptr, position_ptr, cut_ptr, best_ptr, index_ptr,
    max_ptr, stride_row, VOCAB, NUM_CHUNKS,
    HAS_CUT: tl.constexpr, WITH_MAX: tl.constexpr, BLOCK: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
):  # fmt: skip
    """Each chunk's best (score, index); WITH_MAX: also its largest kept logit."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    cut = float("-inf")
    if HAS_CUT:
        cut = tl.load(cut_ptr + row)
    key1, key2 = _row_keys(seed_ptr, position_ptr, row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], dtype=tl.int32)
    top_kept = tl.full([BLOCK], float("-inf"), tl.float32)
    start = chunk * BLOCK * CHUNK_BLOCKS
    for b in range(CHUNK_BLOCKS):
        cols = start + b * BLOCK + tl.arange(0, BLOCK)
        mask = cols < VOCAB
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        noisy = x * inv_t + _gumbel(cols, key1, key2)
        score = tl.where(greedy, x, tl.where(x >= cut, noisy, float("-inf")))
        better = score > best  # strictly: the first block's token wins a tie
        best = tl.where(better, score, best)
        best_at = tl.where(better, cols, best_at)
        if WITH_MAX:
            top_kept = tl.maximum(top_kept, tl.where(x >= cut, x, float("-inf")))
    top = tl.max(best, axis=0)
    # the smallest index among the lanes holding the best score (-inf rows: VOCAB)
    at = tl.min(tl.where(best == top, best_at, 2147483647), axis=0)
    tl.store(best_ptr + row * NUM_CHUNKS + chunk, top)
    tl.store(index_ptr + row * NUM_CHUNKS + chunk, at.to(tl.int64))
    if WITH_MAX:
        tl.store(max_ptr + row * NUM_CHUNKS + chunk, tl.max(top_kept, axis=0))


def _check(logits, temperature, seeds, positions, cut) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with contiguous rows: {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point: {logits.dtype}")
    rows = logits.shape[0]
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("seeds", seeds, torch.int64),
        ("positions", positions, torch.int64),
        ("cut", cut, torch.float32),
    ):
        if t is None:
            continue
        if t.shape != (rows,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous [{rows}] {dtype}: {list(t.shape)} {t.dtype}"
            )
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, the logits on {logits.device}")


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous), temperature [B] float32 (0: the
    row is greedy), seeds and positions [B] int64, cut [B] float32 (a sampled row keeps
    the tokens whose logit is >= its cut; None: all) -> tokens [B] int64. Nothing is
    read back to the host."""
    _check(logits, temperature, seeds, positions, cut)
    rows, vocab = logits.shape
    block = min(_BLOCK, triton.next_power_of_2(max(vocab, 1)))
    chunk_blocks = min(_CHUNK_BLOCKS, triton.cdiv(vocab, block))
    num_chunks = triton.cdiv(vocab, block * chunk_blocks)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, num_chunks), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return index.new_empty(0)
    _sample_kernel[(rows, num_chunks)](
        logits, temperature, seeds, positions, temperature if cut is None else cut, best,
        index, best, logits.stride(0), vocab, num_chunks, HAS_CUT=cut is not None,
        WITH_MAX=False, BLOCK=block, CHUNK_BLOCKS=chunk_blocks, num_warps=4,
    )  # fmt: skip
    if num_chunks == 1:
        return index.view(rows)
    return index.gather(1, best.argmax(dim=1, keepdim=True)).view(rows)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32): the product split so nothing overflows."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def hash32_reference(x: torch.Tensor) -> torch.Tensor:
    """The kernel's `_hash32` on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def gumbel_noise_reference(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: int
) -> torch.Tensor:
    """The Gumbel noise [B, vocab] float32 the kernel adds for rows with these seeds and
    positions ([B] int64 each)."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32  # arithmetic shift, masked: the uint64's high half
    key0 = hash32_reference(lo ^ hash32_reference(hi ^ _SALT_SEED))
    key1 = hash32_reference(key0 ^ (positions & _MASK32))
    key2 = hash32_reference(key1 ^ _SALT_KEY)
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    bits = hash32_reference(hash32_reference(cols ^ key1[:, None]) ^ key2[:, None])
    u = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return -torch.log(-torch.log(u))


def sample_tokens_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same draw in plain torch (the sampler's path on the CPU)."""
    _check(logits, temperature, seeds, positions, cut)
    x = logits.float()
    greedy = temperature == 0.0
    inv_t = 1.0 / torch.where(greedy, 1.0, temperature)
    noisy = x * inv_t[:, None] + gumbel_noise_reference(seeds, positions, x.shape[1])
    if cut is not None:
        noisy = noisy.masked_fill(x < cut[:, None], float("-inf"))
    return torch.where(greedy[:, None], x, noisy).argmax(dim=1)
