"""Block-scaled FP8 GEMMs (W8A8: 1 x 128 activation groups, 128 x 128 weight blocks) on
the GPU against bf16 at the same shapes.

Dense, at DeepSeek-V3's projection shapes from one decode row to a 4,096-row prefill
chunk: kernels/fp8_gemm.py's block_scaled_mm with the activations' quantization
(kernels/fp8_quant.py) in the time (its default launch for the row count, then a sweep),
torch's blockwise `scaled_mm` on the same operands (the activations quantized outside
its time: the GEMM alone), and bf16 F.linear over the dequantized weights. MoE: a
gate_up expert GEMM (64 experts, hidden 2048, intermediate 1024, top-6, W6's shape)
through kernels/fp8_moe.py (quantization included) against bf16 torch._grouped_mm over
the same token-sorted rows. Rates: the weight bytes read once over the time (decode is
bound by them) against the copy ceiling. Each FP8 result's largest difference from the
bf16 product of the dequantized weights is shown.

    python3 -m benchmarks.bench_fp8            # defaults plus the launch sweep
    python3 -m benchmarks.bench_fp8 --quick    # default launches only
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

BLOCK = (128, 128)
DENSE = [("V3 q_a", 1536, 7168), ("V3 o", 7168, 16384), ("V3 mlp down/8", 7168, 2304)]
ROWS = (1, 16, 64, 512, 4096)
LAUNCHES = [  # (block_m, block_n, warps, stages, split_k)
    (16, 64, 4, 4, 1),
    (16, 64, 4, 4, 4),
    (16, 128, 4, 4, 2),
    (32, 64, 4, 3, 1),
    (64, 128, 8, 3, 1),
    (128, 128, 8, 3, 1),
]


def _weights(n: int, k: int, gen, experts: int | None = None):
    from batchgen.layers.quant.fp8 import dequantize
    from batchgen.layers.quant.fp8_experts import quantize_experts

    shape = (n, k) if experts is None else (experts, n, k)
    q, scale = quantize_experts(torch.randn(*shape, generator=gen) * 0.02, BLOCK)
    if experts is None:
        dense = dequantize(q, scale, BLOCK)
    else:
        dense = torch.stack([dequantize(q[e], scale[e], BLOCK) for e in range(experts)])
    return q.cuda(), scale.cuda(), dense.to("cuda", torch.bfloat16)


def _quantized_mm(x, q, scale, tuning=None):
    from batchgen.kernels.fp8_gemm import block_scaled_mm
    from batchgen.kernels.fp8_quant import quantize_groups

    a, a_scale = quantize_groups(x, BLOCK[1])
    return block_scaled_mm(a, a_scale, q, scale, BLOCK, x.dtype, tuning=tuning)


def bench_dense(gen, sweep: bool) -> list[tuple]:
    from batchgen.kernels.fp8_gemm import Fp8GemmTuning, scaled_mm_blockwise
    from batchgen.kernels.fp8_quant import quantize_groups

    rows = []
    for name, n, k in DENSE:
        q, scale, dense = _weights(n, k, gen)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            ref = torch.nn.functional.linear(x, dense)
            case = f"{name} [{m}, {k}] x [{n}, {k}]"
            bf16 = partial(torch.nn.functional.linear, x, dense)
            rows.append(weight_read_row(case, "bf16 F.linear", kernel_seconds(bf16), n * k * 2))
            tunings = [None] + ([Fp8GemmTuning(*t) for t in LAUNCHES] if sweep else [])
            for tn in tunings:
                run = partial(_quantized_mm, x, q, scale, tn)
                err = (run().float() - ref.float()).abs().max().item()
                label = "fp8 triton default" if tn is None else (
                    f"fp8 triton {tn.block_m}x{tn.block_n} w{tn.num_warps} s{tn.num_stages} "
                    f"k/{tn.split_k}"
                )  # fmt: skip
                rows.append(weight_read_row(case, label, kernel_seconds(run), n * k, err))
            a, a_scale = quantize_groups(x, BLOCK[1])
            try:
                run = partial(scaled_mm_blockwise, a, a_scale, q, scale, torch.bfloat16)
                err = (run().float() - ref.float()).abs().max().item()
                rows.append(
                    weight_read_row(case, "torch scaled_mm", kernel_seconds(run), n * k, err)
                )
            except (RuntimeError, NotImplementedError, ValueError) as e:
                rows.append((case, "torch scaled_mm", "-", "-", "-", str(e).splitlines()[0][:60]))
    return rows


def bench_moe(gen, sweep: bool) -> list[tuple]:
    from batchgen.kernels.fp8_moe import tuning_for
    from batchgen.kernels.fused_moe import MoETuning, align_pairs
    from batchgen.layers.quant.fp8_experts import Fp8Experts, fp8_expert_gemm

    q, scale, dense = _weights(2 * MOE_INTER, MOE_HIDDEN, gen, MOE_EXPERTS)
    w = Fp8Experts(q, scale, BLOCK)
    rows = []
    for case, x, flat, ref, w_bytes, bf16_row in moe_gate_up_cases(gen, dense):
        rows.append(bf16_row)
        pairs = flat.numel()
        launches = [tuning_for(pairs, MOE_EXPERTS)] + (
            [MoETuning(*c) for c in [(16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (64, 128, 128, 8, 3)]]
            if sweep
            else []
        )  # fmt: skip
        for tn in launches:
            aligned = align_pairs(flat, MOE_EXPERTS, tn.block_m)
            run = partial(fp8_expert_gemm, x, w, aligned, pairs, MOE_TOP_K, tn)
            err = (run().float() - ref.float()).abs().max().item()
            label = f"fp8 {tn.block_m}x{tn.block_n} w{tn.num_warps} s{tn.num_stages}"
            rows.append(weight_read_row(case, label, kernel_seconds(run), w_bytes // 2, err))
    return rows


def main(argv: list[str] | None = None) -> int:
    return weight_bench_main("bench_fp8", __doc__, (bench_dense, bench_moe), argv)


if __name__ == "__main__":
    sys.exit(main())
