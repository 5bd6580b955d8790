"""Linear layers whose weights may be stacked from several checkpoint tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` names row ranges of W filled by separate checkpoint
    tensors, e.g. {"q": (0, 2048), "k": (2048, 2560), "v": (2560, 3072)}."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor into `weight` or `bias`, whole or into a shard's rows."""
        if param not in ("weight", "bias"):
            raise ValueError(f"unexpected checkpoint parameter {param!r} (weight or bias)")
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param} this layer does not use")
        if shard is not None:
            start, end = self.shards[shard]
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
