"""The attention layer models use: stores new K/V into its layer's pages, then attends.

FP8 pages with a checkpoint's KV scales (layers/kv_scales.py): K and V are stored
divided by their scales, and the scales fold into the softmax scale (or the query's
heads) and the output, so both backends' kernels read the pages as they are."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.forward_context import get_forward_context
from batchgen.kv_quant import is_fp8
from batchgen.layers import attention_torch
from batchgen.layers.kv_scales import KVScales, divide, per_query_head


class Attention(nn.Module):
    """Paged attention for one layer. Its KV pages come from the bound ForwardContext,
    looked up by `layer_id` (the pool owns the tensors). Under tensor parallel its
    `num_kv_heads` are the model's `total_kv_heads` from `first_kv_head` on (what a
    per-head KV scale is cut by)."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        first_kv_head: int = 0,
        total_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_scales = KVScales(num_kv_heads, first_kv_head, total_kv_heads)

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """A checkpoint's KV-cache scale: `param` "k", "v" or "kv" (kv_scales.split_name)."""
        self.kv_scales.load(param, tensor)

    def filled_by(self, param: str, tensor: torch.Tensor) -> tuple[str, ...]:
        return ()  # a scale fills no parameter: without one, 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
        ctx = get_forward_context()
        if ctx.before_layer is not None:
            ctx.before_layer(self.layer_id)
        k_cache, v_cache = ctx.kv_caches[self.layer_id]
        meta = ctx.metadata
        backend = _BACKENDS[ctx.attention_backend]
        scaled = is_fp8(k_cache.dtype) and not self.kv_scales.unit
        if scaled:
            k_scale, v_scale = self.kv_scales.on(q.device)
            k, v = divide(k, k_scale), divide(v, v_scale)
        backend.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if ctx.on_kv_written is not None:
            ctx.on_kv_written(self.layer_id)
        if not scaled:
            return backend.paged_attention(
                q, k_cache, v_cache, meta, self.scale, self.sliding_window
            )
        return self._scaled_attention(backend, q, k_cache, v_cache, meta)

    def _scaled_attention(self, backend, q, k_cache, v_cache, meta) -> torch.Tensor:
        """paged_attention over pages stored divided by the KV scales: the key scale in
        the softmax scale (a per-head one on the query's heads), the value scale on the
        output."""
        k_scale, v_scale = self.kv_scales.on(q.device)
        scales = self.kv_scales
        scale = self.scale
        if scales.k_shared is not None:
            scale *= scales.k_shared
        else:
            q = (q.float() * per_query_head(k_scale, self.num_heads)).to(q.dtype)
        out = backend.paged_attention(q, k_cache, v_cache, meta, scale, self.sliding_window)
        if scales.v_shared == 1.0:
            return out
        if scales.v_shared is not None:
            return out * scales.v_shared
        return (out.float() * per_query_head(v_scale, self.num_heads)).to(out.dtype)


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
