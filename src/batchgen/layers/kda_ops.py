"""Which KDA implementation runs: flash-linear-attention's kernels on CUDA, torch elsewhere.

Every function here takes the packed step as `LinearAttentionMetadata` describes it and
the layer's slot tensors from the pool, and updates the slots of the step's requests in
place (nothing else is written):

    states  [num_slots, H, Dk, Dv] float32    windows [num_slots, K - 1, conv_dim]

fla-core (pip `fla-core`, pure Triton) serves CUDA tensors when it imports:
`fused_recurrent_kda_fwd` for decode-only steps (reads and writes the slots in place
through `ssm_state_indices`: no gather, no host sync, capturable), `chunk_kda` with
`cu_seqlens` for steps with a prefill (initial states gathered from the slots, final
states scattered back). The short convolution runs the torch code on every device:
`short_conv_packed` (all requests of a step at once) or `short_conv_decode`.
"""

from __future__ import annotations

import functools

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
    return kda_torch.short_conv_packed(x, weight, windows, meta.cu_seqlens, meta.state_slots)


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
    if q.is_cuda and fla_kda() is not None:
        return _kda_fla(q, k, v, g, beta, states, meta)
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


@functools.cache
def fla_kda():
    """fla-core's KDA entry points (chunk_kda, fused_recurrent_kda_fwd), or None where it
    is not installed."""
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    return chunk_kda, fused_recurrent_kda_fwd


def _kda_fla(q, k, v, g, beta, states, meta):
    chunk_kda, fused_recurrent_kda_fwd = fla_kda()
    scale = q.shape[-1] ** -0.5
    # the kernels index rows as if contiguous: q, k, v arrive as views of the conv output
    q, k, v, g, beta = (x.contiguous().unsqueeze(0) for x in (q, k, v, g.float(), beta))
    if meta.max_q_len == 1:
        o, _ = fused_recurrent_kda_fwd(
            q, k, v, g, beta,
            initial_state=states,
            scale=scale,
            inplace_final_state=True,
            cu_seqlens=meta.cu_seqlens,
            ssm_state_indices=meta.state_slots,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return o[0]
    o, final = chunk_kda(
        q, k, v, g, beta,
        scale=scale,
        initial_state=states.index_select(0, meta.state_slots),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=meta.cu_seqlens,
        cu_seqlens_cpu=meta.cu_seqlens_host,
    )  # fmt: skip
    states.index_copy_(0, meta.state_slots, final.float())
    return o[0]
