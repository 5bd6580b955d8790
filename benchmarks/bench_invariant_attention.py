"""The batch-invariant attention kernel (deterministic=True) against the engine's usual ones.

kernels/invariant_attention.py never splits a request's keys and tiles (query, head)
rows 16 at a time (up to `subtiles` tiles a program sharing key loads), decode and
prefill alike; decode_attention splits the keys by the
batch and prefill_attention tiles 128 queries of one head. This times both on the GPU
(triton.testing.do_bench medians, bf16, pages of 16 at random through the pool) so the
attention's share of deterministic=True's cost, and the invariant tuning, can be read
apart from the end-to-end probe (benchmarks/invariance.py):

- gqa: W1's geometry (16 query heads, 8 KV heads, 128 wide): decode 256 x 1,024 and
  32 x 2,048 (where splits matter), prefill 8 chunks of 1,024 after no prefix;
  against decode_attention and prefill_attention;
- mla: W4's absorbed geometry (16 heads over one 512 + 64 latent head): decode against
  mla_decode; the prefill (absorbed, as the deterministic path runs it) alone, the plain
  path's decompressed prefill being other work.

    python3 -m benchmarks.bench_invariant_attention            # defaults + tuning sweep
    python3 -m benchmarks.bench_invariant_attention --quick    # defaults only
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_invariant_attention --small  # CPU smoke

Every invariant tuning of the sweep is a candidate for invariant_attention.GPU_TUNING
(one tuning for decode and prefill: a decoded token has the same bits as prefilled).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.card import kernel_seconds, page_table

PAGE = 16


@dataclass(frozen=True)
class Setup:
    """Where and at what size the cases run; shapes: name -> (seq_lens, q_lens)."""

    device: str
    dtype: torch.dtype
    gqa: dict
    mla: dict
    shapes: dict


FULL = Setup(
    "cuda",
    torch.bfloat16,
    gqa=dict(heads=16, kv_heads=8, dim=128),
    mla=dict(heads=16, lora=512, rope=64),
    shapes={
        "decode 256x1024": ([1024] * 256, [1] * 256),
        "decode 32x2048": ([2048] * 32, [1] * 32),
        "prefill 8x1024": ([1024] * 8, [1024] * 8),
    },
)
SMALL_SHAPES = {"decode 4x40": ([40] * 4, [1] * 4), "prefill 2x24": ([24] * 2, [24] * 2)}


def _tunings(setup: Setup, sweep: bool, width: int) -> list:
    from batchgen.kernels import invariant_attention as ia

    default = ia.default_tuning(torch.empty(0, device=setup.device, dtype=setup.dtype), width)
    if not sweep or setup.device == "cpu":
        return [default]
    # (block_m, block_n, num_warps, num_stages, subtiles)
    extra = [(16, 64, 4, 2, 1), (16, 64, 4, 2, 2), (16, 64, 4, 3, 4), (16, 128, 4, 2, 4)]
    extra += [(32, 64, 4, 2, 2), (64, 64, 4, 2, 1)]
    if width > 256:
        extra = [(16, 16, 4, 2, 2), (16, 32, 4, 1, 1), (16, 32, 4, 1, 4), (32, 32, 8, 1, 1)]
    return [default] + [ia.InvariantAttentionTuning(*t) for t in extra]


def _case(setup: Setup, kind: str, seq_lens: list[int], q_lens: list[int], gen):
    """(plain kernel call or None, invariant call taking a tuning, key width) for one shape."""
    from batchgen.kernels.decode_attention import decode_attention
    from batchgen.kernels.invariant_attention import invariant_attention
    from batchgen.kernels.mla_decode import mla_decode
    from batchgen.kernels.prefill_attention import prefill_attention

    gqa, mla = setup.gqa, setup.mla
    pages = sum(math.ceil(n / PAGE) for n in seq_lens) + 8
    table = page_table(seq_lens, pages, PAGE, gen, setup.device)
    lens = torch.tensor(seq_lens, device=setup.device)
    q_len = torch.tensor(q_lens, device=setup.device)
    q_start = torch.tensor([0] + q_lens[:-1], device=setup.device).cumsum(0)
    rows, decode = sum(q_lens), max(q_lens) == 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(setup.device, setup.dtype)

    if kind == "gqa":
        q = randn(rows, gqa["heads"], gqa["dim"])
        k = randn(pages, PAGE, gqa["kv_heads"], gqa["dim"])
        v = randn(pages, PAGE, gqa["kv_heads"], gqa["dim"])
        rope, width = {}, gqa["dim"]
        if decode:
            plain = lambda: decode_attention(q, k, v, table, lens, 0.088)  # noqa: E731
        else:
            args = (q, k, v, q_start, q_len, lens, table, max(q_lens), 0.088)
            plain = lambda: prefill_attention(*args)  # noqa: E731
    else:
        q = randn(rows, mla["heads"], mla["lora"])
        latent = randn(pages, PAGE, 1, mla["lora"] + mla["rope"])
        q_pe = randn(rows, mla["heads"], mla["rope"])
        k = v = latent[..., : mla["lora"]]
        rope, width = (
            dict(q_rope=q_pe, k_rope=latent[..., mla["lora"] :]),
            mla["lora"] + mla["rope"],
        )
        plain = (lambda: mla_decode(q, q_pe, latent, table, lens, 0.04)) if decode else None

    def invariant(tuning):
        invariant_attention(
            q, k, v, q_start, q_len, lens, table, max(q_lens), 0.088, tuning=tuning, **rope
        )

    return plain, invariant, width


def _once(fn) -> float:
    """One call's seconds (the CPU smoke run: no repeats)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default tunings only")
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU, one call each")
    args = ap.parse_args(argv)
    setup = FULL
    if args.small:  # tiny shapes, on the GPU where there is one, else in the interpreter
        cpu = not torch.cuda.is_available()
        setup = Setup(
            "cpu" if cpu else "cuda",
            torch.float32 if cpu else torch.bfloat16,
            gqa=dict(heads=4, kv_heads=2, dim=16),
            mla=dict(heads=4, lora=32, rope=16),
            shapes=SMALL_SHAPES,
        )
    elif not torch.cuda.is_available():
        sys.stderr.write("bench_invariant_attention needs a CUDA device (or --small)\n")
        return 2
    timed = kernel_seconds if setup.device == "cuda" else _once
    gen = torch.Generator().manual_seed(0)
    lines = []
    for kind in ("gqa", "mla"):
        for name, (seq_lens, q_lens) in setup.shapes.items():
            plain, invariant, width = _case(setup, kind, seq_lens, q_lens, gen)
            base = timed(plain) if plain is not None else None
            for tuning in _tunings(setup, not args.quick, width):
                seconds = timed(lambda t=tuning, f=invariant: f(t))
                launch = f"m={tuning.block_m} n={tuning.block_n} w={tuning.num_warps} "
                launch += f"s={tuning.num_stages} t={tuning.subtiles}"
                vs = f"{seconds / base:.2f}x plain ({base * 1e6:.1f} us)" if base else "-"
                lines.append(f"{kind:<4} {name:<16} {launch:<20} {seconds * 1e6:9.1f} us  {vs}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
