"""The per-step context that attention layers read: metadata and KV caches by layer.

The runner binds one ForwardContext around each forward; layers fetch it with
`get_forward_context()`. Binding refuses nesting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One request in the step with more than one new token (host-side ints)."""

    q_start: int  # first row of its queries in the packed batch
    q_len: int
    seq_len: int  # tokens in its KV once this step's tokens are written
    pages: torch.Tensor  # [ceil(seq_len / page_size)] int64, on the device


@dataclass
class AttentionMetadata:
    """Packed variable-length batch, queries ordered as the scheduler listed requests.

    packed rows: | req0 chunk ....... | req1 (1 decode) | req2 chunk ... |
    slot_mapping[t] = page_table[req][pos_t // page_size] * page_size + pos_t % page_size
    """

    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # decode rows (q_len == 1), gathered for one batched attention
    decode_rows: torch.Tensor | None = None  # [num_decodes] int64 row in the packed batch
    decode_page_table: torch.Tensor | None = None  # [num_decodes, max_pages] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64
    decode_max_seq_len: int = 0
    decode_num_splits: int | None = None  # fixed split count (graph and eager alike)
    prefills: list[PrefillSeq] = field(default_factory=list)
    # the same prefill requests as padded tensors, for kernels that take them at once
    prefill_q_start: torch.Tensor | None = None  # [num_prefills] int64
    prefill_q_len: torch.Tensor | None = None  # [num_prefills] int64
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefills] int64
    prefill_page_table: torch.Tensor | None = None  # [num_prefills, max_pages] int64
    prefill_max_q_len: int = 0


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    # per layer, one cache per component of the model's KVState: (k, v) or (latent,)
    kv_caches: list[tuple[torch.Tensor, ...]]
    attention_backend: str = "torch"  # "torch" (reference) or "triton"
    on_kv_written: Callable[[int], None] | None = None  # hook(layer) after its K/V write
    # hook(layer) before a layer touches its KV pages: waits for the pages a copy loads
    # into that layer (or must read from it first) on the compute stream
    before_layer: Callable[[int], None] | None = None


_current: ForwardContext | None = None


@contextmanager
def bind_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("a ForwardContext is already bound: forwards cannot nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no ForwardContext bound: run the model through the ModelRunner")
    return _current
