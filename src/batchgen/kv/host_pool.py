"""The host page pool: pinned memory with the device pool's page geometry."""

from __future__ import annotations

import torch

from batchgen.kv.layout import KVLayout
from batchgen.kv.pinned import host_empty


class HostPool:
    """Host pages, layer-major: [num_layers, num_pages, num_components, page_size,
    num_kv_heads, head_dim] (KVLayout.host_shape). One layer of a run of consecutive host pages is contiguous, so a
    layer-by-layer transfer moves it in one copy; the same (layer, page, component, slot)
    addressing as the device pool. Allocated uninitialised (pinned.host_empty: pinned at
    exactly its size when `pin`): a host page is never read before a copy has written it
    (the tier's lifecycle guarantees it).
    """

    def __init__(self, layout: KVLayout, num_pages: int, pin: bool) -> None:
        if num_pages < 1:
            raise ValueError("the host KV pool needs at least one page (raise host_kv_size_gib)")
        self.layout = layout
        self.num_pages = num_pages
        self.kv = host_empty(layout.host_shape(num_pages), layout.dtype, pin)

    def page(self, page: int) -> torch.Tensor:
        """One host page, [num_layers, num_components, page_size, num_kv_heads, head_dim]
        (a view)."""
        return self.kv[:, page]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def pages_in(layout: KVLayout, gib: float) -> int:
        """Host pages of `layout` that `gib` GiB hold."""
        return int(gib * 2**30 // layout.bytes_per_page)

    @classmethod
    def sized(cls, layout: KVLayout, gib: float, pin: bool) -> HostPool:
        return cls(layout, cls.pages_in(layout, gib), pin)
