"""Page geometry of a model's KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """MHA/GQA layout: per layer, K and V pages of [page_size, num_kv_heads, head_dim].

    The pool stores all layers in one tensor [num_layers, 2, num_pages, page_size,
    num_kv_heads, head_dim], so a page id addresses the same slot in every layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)
