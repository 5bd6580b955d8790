"""INT4 weight-only GEMMs (W4A16, group 32) on the GPU against bf16 at the same shapes.

Dense: kernels/int4_gemm.py's w4a16_gemm (its default launch for the row count, then a
sweep) against torch's bf16 F.linear, at W6's projection shapes (hidden 2048) and
Kimi-K2's expert shape (hidden 7168, intermediate 2048), from one decode row to a 4,096-row
prefill chunk. MoE: W6's routed experts' gate_up GEMM (64 experts, hidden 2048,
intermediate 1024, top-6) through kernels/int4_moe.py against the bf16 grouped GEMM
(torch._grouped_mm over the same token-sorted rows). Rates: the weight bytes read once
over the time (decode is bound by them) against the copy ceiling. Each INT4 result's
largest difference from the bf16 product over the same dequantized weights is shown.
The sweep tries each launch with both ways of unpacking a tile (int4_gemm.unpack_tile:
words split by a reshape, or gathered per row: "gather").

    python3 -m benchmarks.bench_int4            # defaults plus the launch sweep
    python3 -m benchmarks.bench_int4 --quick    # default launches only
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from benchmarks.card import (
    MOE_EXPERTS,
    MOE_HIDDEN,
    MOE_INTER,
    MOE_TOP_K,
    kernel_seconds,
    moe_gate_up_cases,
    weight_bench_main,
    weight_read_row,
)

GROUP = 32
DENSE = [("W6 qkv", 4096, 2048), ("W6 o", 2048, 2048), ("K2 expert up", 4096, 7168)]
ROWS = (1, 16, 64, 512, 4096)
LAUNCHES = [  # (block_m, block_n, block_k, split_k, warps, stages)
    (16, 64, 128, 1, 4, 4),
    (16, 128, 128, 1, 4, 4),
    (16, 64, 256, 1, 4, 3),
    (16, 32, 128, 1, 2, 4),
    (32, 64, 128, 1, 4, 3),
    (64, 128, 64, 1, 8, 3),
    (128, 128, 64, 1, 8, 3),
    (64, 64, 128, 1, 4, 4),
]

MOE_LAUNCHES = [  # (block_m, block_n, block_k, warps, stages)
    (16, 64, 128, 4, 3),
    (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 128, 64, 8, 3),
    (128, 64, 64, 8, 3),
    (16, 64, 64, 4, 4),
]


def _packed(n: int, k: int, gen, experts: int | None = None):
    from batchgen.kernels.int4_gemm import dequantize_int4

    shape = (n, k // 8) if experts is None else (experts, n, k // 8)
    packed = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)
    scale = (torch.rand(*shape[:-1], k // GROUP, generator=gen) * 0.01).to(torch.bfloat16)
    packed, scale = packed.to("cuda"), scale.to("cuda")
    return packed, scale, dequantize_int4(packed, scale, k, GROUP, torch.bfloat16)


def bench_dense(gen, sweep: bool) -> list[tuple]:
    from batchgen.kernels.int4_gemm import W4A16Tuning, w4a16_gemm

    rows = []
    for name, n, k in DENSE:
        packed, scale, dense = _packed(n, k, gen)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            ref = torch.nn.functional.linear(x, dense)
            case = f"{name} [{m}, {k}] x [{n}, {k}]"
            rows.append(
                weight_read_row(
                    case,
                    "bf16 F.linear",
                    kernel_seconds(partial(torch.nn.functional.linear, x, dense)),
                    n * k * 2,
                )
            )
            swept = [W4A16Tuning(*t, gather=g) for t in LAUNCHES for g in (False, True)]
            tunings = [None] + (swept if sweep else [])
            for tn in tunings:
                run = partial(w4a16_gemm, x, packed, scale, GROUP, tuning=tn)
                err = (run().float() - ref.float()).abs().max().item()
                label = "int4 default" if tn is None else (
                    f"int4 {tn.block_m}x{tn.block_n}x{tn.block_k} s{tn.split_k} w{tn.num_warps}"
                    + (" gather" if tn.gather else "")
                )  # fmt: skip
                rows.append(weight_read_row(case, label, kernel_seconds(run), n * k // 2, err))
    return rows


def bench_moe(gen, sweep: bool) -> list[tuple]:
    from batchgen.kernels.fused_moe import align_pairs
    from batchgen.kernels.int4_moe import Int4MoETuning, int4_moe_gemm, tuning_for

    packed, scale, dense = _packed(2 * MOE_INTER, MOE_HIDDEN, gen, MOE_EXPERTS)
    rows = []
    for case, x, flat, ref, w_bytes, bf16_row in moe_gate_up_cases(gen, dense):
        rows.append(bf16_row)
        pairs = flat.numel()
        launches = [tuning_for(pairs, MOE_EXPERTS)] + (
            [Int4MoETuning(*c, gather=g) for c in MOE_LAUNCHES for g in (False, True)]
            if sweep
            else []
        )  # fmt: skip
        for tn in launches:
            aligned = align_pairs(flat, MOE_EXPERTS, tn.block_m)
            run = partial(int4_moe_gemm, x, packed, scale, GROUP, *aligned, pairs, MOE_TOP_K, tn)
            err = (run().float() - ref.float()).abs().max().item()
            label = f"int4 {tn.block_m}x{tn.block_n}x{tn.block_k} w{tn.num_warps}"
            label += " gather" if tn.gather else ""
            rows.append(weight_read_row(case, label, kernel_seconds(run), w_bytes // 4, err))
    return rows


def main(argv: list[str] | None = None) -> int:
    return weight_bench_main("bench_int4", __doc__, (bench_dense, bench_moe), argv)


if __name__ == "__main__":
    sys.exit(main())
