"""What one token leaves in one layer's KV cache, as a model declares it.

Models cannot import the kv package (it sits above them), so they describe their cache
state with this plain value and the engine builds the page layout (kv.layout.KVLayout)
from it:

    MHA/GQA  KVState.mha(num_kv_heads, head_dim)   components K, V   each [Hkv, D]
    MLA      KVState.latent(kv_lora_rank + rope)   one component     [1, kv_lora + rope]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVState:
    """Per token per layer: `components` tensors of [heads, dim] each."""

    components: int
    heads: int
    dim: int

    def __post_init__(self) -> None:
        if min(self.components, self.heads, self.dim) < 1:
            raise ValueError(f"a KV state needs positive sizes, got {self}")

    @classmethod
    def mha(cls, num_kv_heads: int, head_dim: int) -> KVState:
        """K and V of [num_kv_heads, head_dim]."""
        return cls(2, num_kv_heads, head_dim)

    @classmethod
    def latent(cls, width: int) -> KVState:
        """One shared latent of `width` (MLA: kv_norm(c_kv) then the rope'd k_pe)."""
        return cls(1, 1, width)
