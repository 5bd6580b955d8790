"""Routed experts held as block-scaled FP8 weights (DeepSeek-V3 / Kimi-K2 checkpoints)
and multiplied from that form.

A stack of E experts' weights W_e [N, K] is kept as

    weight [E, N, K]                            float8_e4m3fn
    scale  [E, ceil(N / bn), ceil(K / bk)]      float32 (the checkpoint's weight_scale_inv)

`Fp8Experts` carries the pair through `routed_experts.fused_experts` where a plain
stacked weight goes (`shape` is the weight's): on CUDA with 16-bit activations the two
expert GEMMs are kernels/fp8_moe.py's W8A8 over the token-sorted pairs, each input row
quantized once per token in 1 x bk groups (no host sync: capturable); elsewhere one
expert at a time is dequantized into the activations' dtype and multiplied (the
reference loop), so at most one expert's weight is ever held dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.fp8_moe import TUNING, fp8_moe_gemm, tuning_for
from batchgen.kernels.fp8_quant import quantize_groups
from batchgen.kernels.fused_moe import MoETuning
from batchgen.layers import batch_invariant
from batchgen.layers.quant.fp8 import dequantize, quantize_blocks, w8a8_serves

FP8_MOE_TUNING = TUNING  # the decode launch RoutedExperts uses on CUDA (see moe_tuning)


def moe_tuning(x: torch.Tensor, top_k: int, w: Fp8Experts) -> MoETuning:
    """The launch for x's step: kernels/fp8_moe.tuning_for its pairs and experts; in
    deterministic mode always TUNING (a row's bits must not depend on the batch)."""
    if batch_invariant.active():
        return TUNING
    return tuning_for(x.shape[0] * top_k, w.shape[0])


@dataclass(frozen=True)
class Fp8Experts:
    """E experts' block-scaled FP8 weights [E, N, K] and their scales (module docstring)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K] dequantized into `dtype` (rounded once)."""
        return dequantize(self.weight[e], self.scale[e], self.block).to(dtype)

    def dense(self) -> torch.Tensor:
        """Every expert's weight in float32 [E, N, K] (references and tests)."""
        return torch.stack([self.expert(e, torch.float32) for e in range(self.shape[0])])


def scale_shape(num_experts: int, rows: int, cols: int, block) -> tuple[int, int, int]:
    """The scales' shape for a stack of num_experts weights [rows, cols]."""
    return (num_experts, -(-rows // block[0]), -(-cols // block[1]))


def quantize_experts(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [..., N, K] (one expert, or a stack) -> (float8_e4m3fn weights,
    float32 scales), each expert quantized per block (quantize_blocks)."""
    flat = w.reshape(-1, *w.shape[-2:])
    pairs = [quantize_blocks(e, block) for e in flat]
    q = torch.stack([p[0] for p in pairs]).view(w.shape)
    s = torch.stack([p[1] for p in pairs])
    return q, s.view(*w.shape[:-2], *s.shape[-2:])


def serves(x: torch.Tensor, w: Fp8Experts) -> bool:
    """Whether fp8_expert_gemm runs for x (CUDA, 16-bit activations, block width a power
    of two >= 16); elsewhere the reference loop."""
    bk = w.block[1]
    return w8a8_serves(x) and bk >= 16 and not bk & (bk - 1)


def fp8_expert_gemm(
    a: torch.Tensor,
    w: Fp8Experts,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pairs: int,
    rows_per_token: int,
    tuning: MoETuning,
) -> torch.Tensor:
    """kernels/fp8_moe.py's GEMM over fused_moe.align_pairs' blocks (`aligned`), a's rows
    quantized first: [rows, K] -> [num_pairs, N] in a's dtype."""
    q, q_scale = quantize_groups(a, w.block[1])
    return fp8_moe_gemm(
        q, q_scale, w.weight, w.scale, w.block, *aligned, num_pairs, rows_per_token, a.dtype,
        tuning,
    )  # fmt: skip
