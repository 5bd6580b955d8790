"""Linear layers whose weights may be stacked from several checkpoint tensors, and may be
held quantized (layers/quant: a `LinearMethod` given while the model is on meta)."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.layers import batch_invariant
from batchgen.layers.quant.method import LinearMethod, QuantParam

_PLAIN = QuantParam(torch.float32)  # a plain weight's (and a bias's) units: 1 x 1


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` names row ranges of W filled by separate checkpoint
    tensors, e.g. {"q": (0, 2048), "k": (2048, 2560), "v": (2560, 3072)}.

    `quantizable=False`: a layer whose matrix the model reads itself (MLA's kv_b_proj,
    the lm_head), which therefore stays plain whatever the checkpoint or
    EngineConfig.quantization asks. `quant`: the LinearMethod holding the weight
    (None: the plain `weight`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str, tuple[int, int]] | None = None,
        quantizable: bool = True,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.quantizable = quantizable
        self.quant: LinearMethod | None = None

    def use_method(self, method: LinearMethod) -> None:
        """Hold the weight as `method`'s parameters instead of `weight` (on the device
        `weight` is on: call it on meta, before the model is allocated). ValueError
        where a tensor-parallel rank's slice does not hold whole units of one of them
        (check_units); the layer is then left as it was."""
        if not self.quantizable:
            raise ValueError("this layer's weight is read as a matrix; it stays plain")
        params = method.params()
        self.check_units(params)
        device = self.weight.device
        del self.weight
        for name, spec in params.items():
            shape = (self.unit_rows(spec)[1], -(-self.in_features // spec.cols_per))
            tensor = torch.empty(shape, dtype=spec.dtype, device=device)
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.quant = method

    def check_units(self, params: dict[str, QuantParam]) -> None:
        """Nothing to check for one process: every shard's rows start a unit of their own
        (unit_rows). The tensor-parallel layers check their rank's slice."""

    def unit_rows(self, spec: QuantParam, rows: tuple[int, int] | None = None) -> tuple[int, int]:
        """The rows [start, end) of a parameter with `spec`'s units that cover weight rows
        `rows` (a shard's range, or None: the whole weight). Each shard's rows are cut
        into units from the shard's own first row, its last unit maybe partial, as a
        checkpoint stores each shard's tensor:

            weight rows:  | q: 0..576          | k: 576..768 | v: 768..960 |
            128-row units:| 0 1 2 3 4 (partial)| 5 6 (part.) | 7 8 (part.) |
        """
        per = spec.rows_per
        if not self.shards:
            start, end = rows or (0, self.out_features)
            return start // per, -(-end // per)
        first = 0
        for shard_rows in self.shards.values():
            count = -(-(shard_rows[1] - shard_rows[0]) // per)
            if rows == shard_rows:
                return first, first + count
            first += count
        if rows is None:
            return 0, first
        raise ValueError(f"rows {rows} are not one of the shards {self.shards}")

    def unit_index(self, param: str) -> torch.Tensor | None:
        """int32 [out]: the row of `param` holding each weight row's unit, where a shard
        starts inside a unit of the whole weight's grid; None where row // rows_per is
        that row (no shards, or all on unit boundaries). Kept as buffer `{param}_rows`
        (after_load makes it before any forward)."""
        per = self.units(param).rows_per
        if per == 1 or all(start % per == 0 for start, _ in self.shards.values()):
            return None
        held = getattr(self, f"{param}_rows", None)
        if held is None:
            parts, first = [], 0
            for start, end in self.shards.values():
                parts.append(first + torch.arange(end - start, dtype=torch.int32) // per)
                first += -(-(end - start) // per)
            held = torch.cat(parts).to(getattr(self, param).device)
            self.register_buffer(f"{param}_rows", held, persistent=False)
        return held

    def after_load(self) -> None:
        """Make each quantized parameter's unit_index buffer before the first forward."""
        if self.quant is not None:
            for param in self.quant.params():
                self.unit_index(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias, from the plain weight or through the layer's method."""
        if self.quant is None:
            return batch_invariant.linear(x, self.weight, bias)
        return self.quant.apply(self, x, bias)

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] as a plain matrix (float32 where quantized; the weight itself
        otherwise)."""
        return self.weight if self.quant is None else self.quant.dense_weight(self)

    def units(self, param: str) -> QuantParam:
        """`param`'s units over the weight's [out, in] grid (1 x 1 unless quantized)."""
        if self.quant is None or param == "bias":
            return _PLAIN
        return self.quant.params()[param]

    def param_names(self) -> tuple[str, ...]:
        """The parameters a checkpoint fills (besides the bias)."""
        return ("weight",) if self.quant is None else tuple(self.quant.params())

    def shard_names(self, param: str) -> list[str]:
        """The shards that fill `param` (the loader's check that nothing is left out)."""
        return list(self.shards) if param in (*self.param_names(), "bias") else []

    def filled_by(self, param: str, tensor: torch.Tensor) -> tuple[str, ...]:
        """The parameters `load(param, tensor, ...)` fills: a float weight given to a
        quantized layer fills all of the method's parameters (it is quantized here)."""
        if self._quantizes(param, tensor):
            return self.quant.weight_params()
        return (param,)

    def _quantizes(self, param: str, tensor: torch.Tensor) -> bool:
        if self.quant is None or param != "weight" or "weight" not in self.quant.params():
            return False
        return tensor.dtype != self.weight.dtype

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor into a parameter, whole or into a shard's rows (in
        the parameter's units); a float weight given to a quantized layer is quantized
        into the method's parameters."""
        if param not in (*self.param_names(), "bias"):
            expected = ", ".join((*self.param_names(), "bias"))
            raise ValueError(f"unexpected checkpoint parameter {param!r} ({expected})")
        target = getattr(self, param)
        if target is None:
            raise ValueError(f"checkpoint has a {param} this layer does not use")
        rows = self.shards[shard] if shard is not None else None
        if self._quantizes(param, tensor):
            want = (rows[1] - rows[0] if rows else self.out_features, self.in_features)
            if tuple(tensor.shape) != want:
                raise ValueError(f"shape {tuple(tensor.shape)} != expected {want}")
            self.quant.quantize(self, tensor, rows)
            return
        if rows is not None:
            start, end = self.unit_rows(self.units(param), rows)
            target = target[start:end]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)


def merged_shards(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Consecutive row ranges for the named parts, in the given order."""
    shards, start = {}, 0
    for name, size in sizes.items():
        shards[name] = (start, start + size)
        start += size
    return shards
