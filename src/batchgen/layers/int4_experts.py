"""Routed experts held as INT4 weights (compressed-tensors' `pack-quantized`, the form
Kimi-K2-Thinking ships its experts in) and multiplied from that form.

A stack of E experts' weights W_e [N, K] is kept as

    packed [E, N, K / 8] int32   (kernels/int4_gemm.py: 8 nibbles a word along K)
    scale  [E, N, ceil(K / G)]   (one scale per row and group of G input columns)

`PackedExperts` carries the pair through `routed_experts.fused_experts` where a plain
stacked weight [E, N, K] goes (its `shape` is that weight's): on CUDA the two expert
GEMMs run as kernels/int4_moe.py over the token-sorted pairs (no host sync: capturable);
elsewhere one expert at a time is dequantized into the activations' dtype and
multiplied (`grouped_mm_loop`), so no more than one expert's weight is ever held
dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.fused_moe import MoETuning
from batchgen.kernels.int4_gemm import PACK, dequantize_int4
from batchgen.kernels.int4_moe import int4_moe_gemm, tuning_for


@dataclass(frozen=True)
class PackedExperts:
    """E experts' INT4 weights [E, N, K] as packed [E, N, K / 8] int32 and scale [E, N,
    ceil(K / group_size)]."""

    packed: torch.Tensor
    scale: torch.Tensor
    group_size: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of the dequantized stack: (E, N, K)."""
        return (self.packed.shape[0], self.packed.shape[1], self.in_features)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K] dequantized into `dtype` (rounded once)."""
        return dequantize_int4(
            self.packed[e], self.scale[e], self.in_features, self.group_size, dtype
        )

    def dense(self) -> torch.Tensor:
        """Every expert's weight in float32 [E, N, K] (references and tests)."""
        return dequantize_int4(self.packed, self.scale, self.in_features, self.group_size)


def packed_shapes(
    num_experts: int, rows: int, in_features: int, group_size: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(packed, scale) shapes of a stack of num_experts weights [rows, in_features]."""
    return (
        (num_experts, rows, -(-in_features // PACK)),
        (num_experts, rows, -(-in_features // group_size)),
    )


def moe_tuning(x: torch.Tensor, top_k: int, w: PackedExperts) -> MoETuning:
    """The launch for x's step on CUDA: kernels/int4_moe.tuning_for its pairs and
    experts."""
    return tuning_for(x.shape[0] * top_k, w.shape[0])


def expert_gemm(
    a: torch.Tensor,
    w: PackedExperts,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pairs: int,
    rows_per_token: int,
    tuning: MoETuning,
) -> torch.Tensor:
    """kernels/int4_moe.py's GEMM over fused_moe.align_pairs' blocks (`aligned`)."""
    return int4_moe_gemm(
        a, w.packed, w.scale, w.group_size, *aligned, num_pairs, rows_per_token, tuning
    )
