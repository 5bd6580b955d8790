"""Which KDA implementation runs (the torch reference for now; kernels plug in here).

Every function here takes the packed step as `LinearAttentionMetadata` describes it and
the layer's slot tensors from the pool, and updates the slots of the step's requests in
place (nothing else is written):

    states  [num_slots, H, Dk, Dv] float32    windows [num_slots, K - 1, conv_dim]
"""

from __future__ import annotations

import torch

from batchgen.forward_context import LinearAttentionMetadata
from batchgen.layers import kda_torch


def reset_fresh_slots(
    states: torch.Tensor, windows: torch.Tensor, meta: LinearAttentionMetadata
) -> None:
    """Zero the slots of requests that start this step (a slot is reused unwiped)."""
    states.index_fill_(0, meta.fresh_slots, 0.0)
    windows.index_fill_(0, meta.fresh_slots, 0.0)


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, meta: LinearAttentionMetadata
) -> torch.Tensor:
    """Causal depthwise conv + SiLU of x [T, C] with each request's window, which moves on."""
    if meta.max_q_len == 1:
        return kda_torch.short_conv_decode(x, weight, windows, meta.state_slots)
    return kda_torch.short_conv(x, weight, windows, meta.seqs)


def kda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    meta: LinearAttentionMetadata,
    chunk_size: int = 64,
) -> torch.Tensor:
    """KDA over a packed step: q, k, g [T, H, Dk] (q, k not yet normalised, g the log
    decay), v [T, H, Dv], beta [T, H] -> o [T, H, Dv] in v's dtype; each request continues
    from states[slot] and leaves its final state there."""
    return kda_attention_torch(q, k, v, g, beta, states, meta, chunk_size)


def kda_attention_torch(q, k, v, g, beta, states, meta, chunk_size=64):
    """The reference path of kda_attention: a decode-only step as one batched recurrent
    step on device tensors; otherwise request by request, chunked where q_len > 1."""
    if meta.max_q_len == 1:
        slots = meta.state_slots
        o, new = kda_torch.kda_recurrent(q, k, v, g, beta, states.index_select(0, slots))
        states.index_copy_(0, slots, new)
        return o
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for seq in meta.seqs:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        o, states[seq.slot] = kda_torch.kda_chunk(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states[seq.slot], chunk_size
        )
        out[rows] = o
    return out
