"""INT4 weight-only, group-quantized linear layers (W4A16; compressed-tensors'
`pack-quantized` form, kernels/int4_gemm.py describes the packing).

A layer's weight W [out, in] is held as

    weight_packed [out, in / 8] int32   units 1 x 8 (eight columns a word)
    weight_scale  [out, in / group]     units 1 x group, in the model's dtype

and multiplied from that form: on CUDA by kernels/int4_gemm.py's W4A16 GEMM (nibbles
split in registers; the decode launch for up to 16 rows, the prefill one above);
elsewhere `int4_linear_torch` dequantizes a block of rows at a time into x's dtype, so
only that block is ever held dequantized (on float32, the product with the dequantized
weight, which the CPU tests hold it to). A tensor-parallel rank's slice must hold whole
groups (Linear.use_method checks the units).
"""

from __future__ import annotations

import functools

import torch

from batchgen.kernels.int4_gemm import PACK, dequantize_int4, int4_linear_torch
from batchgen.layers.quant.method import LinearMethod, QuantParam


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class Int4Method(LinearMethod):
    """A layer's weight as `weight_packed` and `weight_scale` (module docstring)."""

    name = "int4"

    def __init__(self, group_size: int, scale_dtype: torch.dtype = torch.bfloat16) -> None:
        if group_size < PACK or group_size % PACK:
            raise ValueError(f"the INT4 group size must be a multiple of {PACK}, got {group_size}")
        self.group_size = group_size
        self.scale_dtype = scale_dtype

    def params(self) -> dict[str, QuantParam]:
        return {
            "weight_packed": QuantParam(torch.int32, 1, PACK),
            "weight_scale": QuantParam(self.scale_dtype, 1, self.group_size),
        }

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed, scale = layer.weight_packed, layer.weight_scale
        if not x.is_cuda:
            return int4_linear_torch(x, packed, scale, self.group_size, bias)
        from batchgen.kernels.int4_gemm import choose_tuning, w4a16_gemm

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        n, k = packed.shape[0], rows.shape[1]
        tuning = choose_tuning(rows.shape[0], n, k, _num_sms(x.device.index or 0))
        out = w4a16_gemm(rows, packed, scale, self.group_size, tuning=tuning)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], n)

    def dense_weight(self, layer) -> torch.Tensor:
        return dequantize_int4(
            layer.weight_packed, layer.weight_scale, layer.in_features, self.group_size
        )
