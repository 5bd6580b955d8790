"""Page geometry of a model's KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kv_state import KVState


@dataclass(frozen=True)
class KVLayout:
    """Per layer, `num_components` page arrays of [page_size, num_kv_heads, head_dim]:
    MHA/GQA keeps two (K, V); MLA one latent of one head, head_dim = kv_lora_rank +
    qk_rope_head_dim (kv_norm(c_kv), then k_pe with rope applied).

    The pool stores all layers in one tensor [num_layers, num_components, num_pages,
    page_size, num_kv_heads, head_dim], so a page id addresses the same slot in every
    layer, and code that moves pages (host tier, copies) never asks which kind it holds.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    num_components: int = 2

    @classmethod
    def of(cls, state: KVState, num_layers: int, page_size: int, dtype: torch.dtype) -> KVLayout:
        """The layout of a model whose every layer keeps `state` per token."""
        return cls(num_layers, state.heads, state.dim, page_size, dtype, state.components)

    @property
    def bytes_per_page(self) -> int:
        elem = self.dtype.itemsize  # no tensor: the tier asks for this per copy
        per_layer = self.num_components * self.page_size * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * elem

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (
            self.num_layers,
            self.num_components,
            num_pages,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    def host_shape(self, num_pages: int) -> tuple[int, ...]:
        """The host pool's layer-major order: one layer of consecutive pages is one block."""
        c, s, h, d = self.num_components, self.page_size, self.num_kv_heads, self.head_dim
        return (self.num_layers, num_pages, c, s, h, d)
