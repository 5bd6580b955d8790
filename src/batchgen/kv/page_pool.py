"""The device page pool: owner of the KV tensors."""

from __future__ import annotations

import torch

from batchgen.kv.layout import KVLayout
from batchgen.kv.pinned import pool_zeros


class PagePool:
    """Allocates the KV tensor once and hands out per-layer views.

    Attention layers never hold the tensor themselves: the runner binds
    `layer_caches()` into the ForwardContext each step.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        if num_pages < 2:
            raise ValueError(
                f"the KV cache holds only {num_pages} page(s) of {layout.page_size} tokens; "
                "give it more memory (kv_cache_size_gib / gpu_memory_utilization)"
            )
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        self.kv = pool_zeros(layout.pool_shape(num_pages), layout.dtype, device)

    def layer_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer one view per component, each [num_pages, page_size, num_kv_heads,
        head_dim]: (k_cache, v_cache) for MHA/GQA, (latent_cache,) for MLA."""
        components = range(self.layout.num_components)
        return [tuple(self.kv[i, c] for c in components) for i in range(self.layout.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
