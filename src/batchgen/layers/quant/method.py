"""The interface between a linear layer and a quantized form of its weight.

A `Linear` (layers/linear.py) holds a plain matrix `weight` [out, in] unless it was given
a `LinearMethod` while the model still sat on the meta device (`Linear.use_method`). The
method then says which parameters the layer holds instead (`params`), fills them from
checkpoint tensors or from a float weight it quantizes itself (`quantize`), and computes
y = x W^T + b from them (`apply`). One method object may serve many layers: it keeps no
per-layer state, everything lives in the layer's parameters.

Every parameter of a method is a 2-D tensor laid over the weight's [out, in] grid in
units: parameter row r covers weight rows [r * rows_per, (r + 1) * rows_per), column c
weight columns [c * cols_per, (c + 1) * cols_per) (the last row and column may be
partial). So the layer (and the tensor-parallel layers, which cut a rank's slice) cut
any parameter exactly as they cut the weight, in its own units:

    block-scaled FP8   weight            float8_e4m3fn  rows_per 1    cols_per 1
                       weight_scale_inv  float32        rows_per 128  cols_per 128
    INT4 (packed)      weight_packed     int32          rows_per 1    cols_per 8
                       weight_scale      bfloat16       rows_per 1    cols_per group

A stacked layer's shards are cut into units each from its own first row, as each
shard's checkpoint tensor is (`Linear.unit_rows`; a shard's last unit may be partial),
so a parameter's rows follow the shards and, where a shard starts inside a unit of
the whole weight's grid, `Linear.unit_index(param)` maps each weight row to its unit's
row. A tensor-parallel rank's slice must hold whole units of every parameter;
`Linear.use_method` refuses a layer where one does not (ValueError), and the loader
then keeps that layer plain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantParam:
    """One parameter a method keeps in a layer: its dtype and its units over the weight
    (see the module docstring)."""

    dtype: torch.dtype
    rows_per: int = 1
    cols_per: int = 1

    def shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (-(-out_features // self.rows_per), -(-in_features // self.cols_per))


class LinearMethod:
    """How a Linear holds and multiplies its weight when it is not one plain matrix.

    Subclasses set `name` and implement `params`, `apply` and `dense_weight`; `quantize`
    where a float checkpoint may be quantized as it loads (EngineConfig.quantization)."""

    name = "unquantized"

    def params(self) -> dict[str, QuantParam]:
        """The parameters (by name) a layer holds under this method."""
        raise NotImplementedError

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> x W^T + bias [..., out] in x's dtype, from the layer's
        parameters."""
        raise NotImplementedError

    def dense_weight(self, layer) -> torch.Tensor:
        """The layer's weight [out, in] in float32, as its parameters hold it (for
        references, and for a model that needs the matrix itself)."""
        raise NotImplementedError

    def quantize(self, layer, weight: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Fill the layer's parameters for weight rows [rows) (None: all of them) from a
        float `weight` of those rows; rows start on a unit boundary. Methods that only
        load quantized checkpoints raise NotImplementedError."""
        raise NotImplementedError(f"{self.name} weights load only from a quantized checkpoint")

    def weight_params(self) -> tuple[str, ...]:
        """The parameters one float weight fills through `quantize` (all of them)."""
        return tuple(self.params())
