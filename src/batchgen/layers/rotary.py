"""Rotary position embedding (neox layout), with transformers' scaling variants.

`forward` is the op-by-op torch rope (each op rounded to q's dtype, as transformers does);
`forward_qkv` is the CUDA path: one Triton kernel (kernels/qk_norm_rope.py) takes the fused
qkv projection, applies the optional per-head q/k RMSNorm, and rotates in float32;
`forward_qkv_store` is the same kernel writing the new K/V into the pages too (the Triton
attention backend's path, taken by layers/attention.py).
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.layers.norm import RMSNorm


def rope_parameters(config) -> dict:
    """The config's rope settings as one dict (transformers 5 keeps rope_theta inside it)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim // 2] in float32 and the attention scaling of cos/sin."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (base**exps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for positions [0, max_positions)."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        self.max_positions = max_positions
        device = torch.empty(0).device
        self.cos = self.sin = None
        if device.type != "meta":
            self.materialize(device)

    def materialize(self, device: torch.device) -> None:
        """(Re)compute the tables in float32 on the CPU and place them on `device`
        (the model is built on the meta device, where they hold no values)."""
        inv_freq, scaling = inverse_frequencies(self.config, self.head_dim)
        freqs = torch.arange(self.max_positions, device="cpu", dtype=torch.float32)[:, None]
        emb = torch.cat((freqs * inv_freq[None, :],) * 2, dim=-1)
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] rotated by their token positions [T]."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel path (Attention.forward_qkv where it does not take forward_qkv_store):
        qkv [T, (H + 2 Hkv) D] -> new
        q [T, H, D], k [T, Hkv, D], each head normalised by q_norm/k_norm (both or neither)
        and rotated by its token's position. qkv is only read; v stays a view of it."""
        from batchgen.kernels.qk_norm_rope import qk_norm_rope

        weights, eps = _norm_weights(q_norm, k_norm)
        return qk_norm_rope(
            qkv, positions, self.cos, self.sin, num_heads, num_kv_heads, *weights, eps
        )

    def forward_qkv_store(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        kv_pages: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """forward_qkv with the K/V write in the same launch (layers/attention.py's
        `Attention.forward_qkv` calls it between its copy-ordering hooks): returns q, and
        writes the new k and qkv's v rows into kv_pages = (k_cache, v_cache) at
        slot_mapping (negative slots skipped), the bytes forward_qkv then store_kv write."""
        from batchgen.kernels.qk_norm_rope import qk_norm_rope_store

        weights, eps = _norm_weights(q_norm, k_norm)
        return qk_norm_rope_store(
            qkv, positions, self.cos, self.sin, num_heads, num_kv_heads, *kv_pages,
            slot_mapping, *weights, eps,
        )  # fmt: skip


def _norm_weights(q_norm: RMSNorm | None, k_norm: RMSNorm | None):
    """((q weight, k weight) or (None, None), eps) for the rope kernels."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm or neither")
    if q_norm is None:
        return (None, None), 0.0
    if q_norm.eps != k_norm.eps:
        raise ValueError(f"q_norm eps {q_norm.eps} != k_norm eps {k_norm.eps}")
    return (q_norm.weight, k_norm.weight), q_norm.eps


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
