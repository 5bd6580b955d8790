"""The attention layer models use: stores new K/V into its layer's pages, then attends."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.forward_context import get_forward_context
from batchgen.layers import attention_torch


class Attention(nn.Module):
    """Paged attention for one layer. Its KV pages come from the bound ForwardContext,
    looked up by `layer_id` (the pool owns the tensors)."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
        ctx = get_forward_context()
        if ctx.before_layer is not None:
            ctx.before_layer(self.layer_id)
        k_cache, v_cache = ctx.kv_caches[self.layer_id]
        meta = ctx.metadata
        backend = _BACKENDS[ctx.attention_backend]
        backend.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if ctx.on_kv_written is not None:
            ctx.on_kv_written(self.layer_id)
        return backend.paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window)


def _triton_backend():
    from batchgen.layers import attention_triton

    return attention_triton


class _Backends(dict):
    """Backend modules by name, imported on first use (triton only when asked for)."""

    def __missing__(self, name: str):
        if name == "triton":
            self[name] = _triton_backend()
            return self[name]
        raise ValueError(f"unknown attention backend {name!r} (torch, triton)")


_BACKENDS = _Backends(torch=attention_torch)
