"""The attention layer models use: stores new K/V into its layer's pages, then attends.

`forward_qkv` takes the fused qkv projection instead (Llama-family models on CUDA or on
the Triton backend): on the Triton backend, with pages not stored divided by KV scales,
one launch (kernels/qk_norm_rope.py's qk_norm_rope_store) ropes q and k and writes k and
v into the pages, between the copy-ordering hooks; otherwise the rope kernel, then the
store as `forward` does it.

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
from batchgen.layers.norm import RMSNorm
from batchgen.layers.rotary import RotaryEmbedding


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
        return self._store_and_attend(ctx, q, k, v, k_cache, v_cache)

    def takes_qkv(self, qkv: torch.Tensor) -> bool:
        """Whether a model should hand this layer its fused qkv rows (`forward_qkv`): on
        CUDA (the rope kernel) and on the Triton backend (the rope and store launch)."""
        return qkv.is_cuda or get_forward_context().attention_backend == "triton"

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] (the fused projection, only read) -> [T, H, D]: q and
        k normalised by q_norm/k_norm (both or neither) and rotated by `rope` at
        `positions`, k and v stored, then attention. One launch does the rope and the
        store on the Triton backend unless the pages are FP8 with KV scales (they divide
        k and v first); else the rope kernel, then the store of `forward`."""
        ctx = get_forward_context()
        if ctx.before_layer is not None:
            ctx.before_layer(self.layer_id)
        k_cache, v_cache = ctx.kv_caches[self.layer_id]
        meta = ctx.metadata
        heads = (self.num_heads, self.num_kv_heads)
        if ctx.attention_backend != "triton" or self._scaled(k_cache):
            q, k = rope.forward_qkv(positions, qkv, *heads, q_norm, k_norm)
            v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_dim :]
            v = v.view(qkv.shape[0], self.num_kv_heads, self.head_dim)
            return self._store_and_attend(ctx, q, k, v, k_cache, v_cache)
        pages = (k_cache, v_cache)
        q = rope.forward_qkv_store(positions, qkv, *heads, pages, meta.slot_mapping, q_norm, k_norm)
        if ctx.on_kv_written is not None:
            ctx.on_kv_written(self.layer_id)
        backend = _BACKENDS[ctx.attention_backend]
        return backend.paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window)

    def _scaled(self, k_cache: torch.Tensor) -> bool:
        """Whether K and V go into the pages divided by a checkpoint's KV scales."""
        return is_fp8(k_cache.dtype) and not self.kv_scales.unit

    def _store_and_attend(self, ctx, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """Store k, v into the layer's pages (divided by the KV scales where they apply),
        call the on_kv_written hook, attend. The caller has called before_layer."""
        meta = ctx.metadata
        backend = _BACKENDS[ctx.attention_backend]
        scaled = self._scaled(k_cache)
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
