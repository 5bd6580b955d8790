"""The per-step context that attention layers read: metadata and KV caches by layer.

The runner binds one ForwardContext around each forward; layers fetch it with
`get_forward_context()`. Binding refuses nesting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


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
    # tensors a layer derives from the above for its kernels, built by the step's first
    # layer and reused by the rest (keyed by the deriving function's name)
    derived: dict[str, object] = field(default_factory=dict)


@dataclass
class LinearSeq:
    """One request in the step, as linear-attention layers see it (host-side ints)."""

    q_start: int  # first row of its tokens in the packed batch
    q_len: int
    slot: int  # its compressed-state slot (kv/state_pool.py)
    has_state: bool  # tokens were computed before this step: continue from the slot


@dataclass
class LinearAttentionMetadata:
    """Every request of the step with its token range and state slot, in packed order.

    packed rows: | req0 (q_len 5) | req1 (1) | req2 (3) |
    cu_seqlens = [0, 5, 6, 9]; state_slots = [slot0, slot1, slot2]

    `seqs` serves the torch reference; the tensors serve kernels and CUDA graphs (a
    decode-only step, max_q_len 1, needs no host ints). A layer zeroes `fresh_slots`
    first, so afterwards every request continues from its slot.
    """

    seqs: list[LinearSeq]
    cu_seqlens: torch.Tensor  # [num_reqs + 1] int64, on the device
    state_slots: torch.Tensor  # [num_reqs] int64, on the device
    fresh_slots: torch.Tensor  # int64 slots of requests without state: zeroed before use
    max_q_len: int
    cu_seqlens_host: torch.Tensor | None = None  # cu_seqlens on the CPU: kernels that size
    # their launch by it need not read it back from the device
    # tensors a layer derives from the above, built by the step's first layer and reused
    # by the rest (keyed by the deriving function's name)
    derived: dict[str, object] = field(default_factory=dict)

    @classmethod
    def build(cls, seqs: list[LinearSeq], device: torch.device | str) -> LinearAttentionMetadata:
        """From host-side seqs (packed order, contiguous rows)."""
        starts = [s.q_start for s in seqs] + [seqs[-1].q_start + seqs[-1].q_len if seqs else 0]
        host = torch.tensor(starts, dtype=torch.int64)
        slots = [s.slot for s in seqs]
        fresh = [s.slot for s in seqs if not s.has_state]
        cu_seqlens, state_slots, fresh_slots = parts_to_device([starts, slots, fresh], device)
        return cls(
            seqs=seqs,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=host,
            state_slots=state_slots,
            fresh_slots=fresh_slots,
            max_q_len=max((s.q_len for s in seqs), default=0),
        )


def pack_aligned(parts: list) -> np.ndarray:
    """int64 parts (arrays or sequences) end to end, each padded to an even length, so
    that each part's view of the packed tensor starts 16-byte aligned: Triton
    specialises a pointer argument on that alignment, and a part starting unaligned in
    one step and aligned in another would compile a kernel anew mid-run."""
    parts = [np.asarray(p, dtype=np.int64).ravel() for p in parts]
    out = np.zeros(sum(p.size + p.size % 2 for p in parts), dtype=np.int64)
    at = 0
    for p in parts:
        out[at : at + p.size] = p
        at += p.size + p.size % 2
    return out


def unpack_aligned(packed: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The views of pack_aligned's parts, of `sizes` elements, in packed (on any device)."""
    out, at = [], 0
    for size in sizes:
        out.append(packed[at : at + size])
        at += size + size % 2
    return out


def parts_to_device(parts: list, device: torch.device | str) -> list[torch.Tensor]:
    """int64 parts (arrays or sequences) on `device` in one copy (to_device), each
    part's view starting 16-byte aligned (pack_aligned)."""
    arrays = [np.asarray(p, dtype=np.int64).ravel() for p in parts]
    packed = to_device(torch.from_numpy(pack_aligned(arrays)), device)
    return unpack_aligned(packed, [a.size for a in arrays])


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor copied to `device`; to a CUDA device through pinned memory and
    without blocking, so that a step's metadata never makes the host wait for the
    work queued before it (a pageable copy synchronises the stream)."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def derived(
    meta: AttentionMetadata | LinearAttentionMetadata, key: str, build: Callable[[], T]
) -> T:
    """meta.derived[key]: built by build() for the step's first layer that asks, the
    same object for every later one."""
    if key not in meta.derived:
        meta.derived[key] = build()
    return meta.derived[key]


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
    # linear-attention (KDA) layers: per such layer (recurrent states [slots, H, Dv, Dk]
    # float32, conv windows [slots, K - 1, conv_dim]), owned by kv/state_pool.py
    linear_states: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    linear_metadata: LinearAttentionMetadata | None = None


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
