"""Which KDA implementation runs: flash-linear-attention's kernels on CUDA, torch elsewhere.

Every function here takes the packed step as `LinearAttentionMetadata` describes it and
the layer's slot tensors from the pool, and updates the slots of the step's requests in
place (nothing else is written):

    states  [num_slots, H, Dv, Dk] float32    windows [num_slots, K - 1, conv_dim]

A state is held value-major, [Dv, Dk] per head (the transpose of the math's S [Dk, Dv]),
the layout fla-core's kernels read fastest (`state_v_first`; bench_kernels.py --kda: the
decode step and the chunked prefill each 6-9% faster than in [Dk, Dv]); the torch path
transposes its views.

fla-core (pip `fla-core`, pure Triton) serves CUDA tensors when it imports:
`fused_recurrent_kda_fwd` for one-token rows (reads and writes the slots in place
through `ssm_state_indices`: no gather, no host sync, capturable; where the gates come
raw, as the layer passes them, kernels/kda_decode.py does the same faster), `chunk_kda` with
`cu_seqlens` for steps with a prefill (initial states gathered from the slots, final
states scattered back), both with the decay gate and beta's sigmoid computed inside the
kernel from the raw projections (`RawGates`); `rms_norm_gated` for the output norm.
The short convolution is ours on CUDA: `conv_decode` for a decode-only step, inside its
graph (fla's update kernel takes no state slots), and `conv_packed` for a step with a
prefill (q, k and v come out contiguous, where fla's causal_conv1d gives one tensor whose
thirds the chunked kernels would copy).
Elsewhere the torch code runs: `short_conv_packed` (all requests of a step at once) or
`short_conv_decode`, `kda_gate`, `gated_rms_norm`.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import numpy as np
import torch

from batchgen.forward_context import (
    LinearAttentionMetadata,
    derived,
    parts_to_device,
    to_device,
)
from batchgen.layers import batch_invariant, kda_invariant, kda_torch


def reset_fresh_slots(
    states: torch.Tensor, windows: torch.Tensor, meta: LinearAttentionMetadata
) -> None:
    """Zero the slots of requests that start this step (a slot is reused unwiped)."""
    states.index_fill_(0, meta.fresh_slots, 0.0)
    windows.index_fill_(0, meta.fresh_slots, 0.0)


class RawGates(NamedTuple):
    """The decay's parameters, for g and beta handed over raw: g = -exp(A_log[h]) *
    softplus(f + dt_bias) from the f projection, beta = sigmoid(b) from the b projection."""

    a_log: torch.Tensor  # H elements, float32
    dt_bias: torch.Tensor  # [H * Dk] float32


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    meta: LinearAttentionMetadata,
    parts: int = 3,
) -> tuple[torch.Tensor, ...]:
    """Causal depthwise conv + SiLU of x [T, C] with each request's window, which moves
    on -> `parts` tensors [T, C / parts], the channels in order (q, k and v); on CUDA
    they come contiguous from one kernel (kernels/conv_decode.py for a decode-only step,
    else kernels/conv_packed.py)."""
    if x.is_cuda:
        slots = meta.state_slots
        if meta.max_q_len == 1:
            from batchgen.kernels.conv_decode import conv_decode

            return conv_decode(x, weight, windows, slots, parts)
        from batchgen.kernels.conv_packed import conv_packed, request_of_row

        cu, count = meta.cu_seqlens, x.shape[0]
        rows = derived(meta, "conv_rows", lambda: request_of_row(cu, count))
        return conv_packed(x, weight, windows, cu, slots, parts, rows)
    if meta.max_q_len == 1 and not batch_invariant.active():  # one row's path, any step
        y = kda_torch.short_conv_decode(x, weight, windows, meta.state_slots)
    else:
        y = kda_torch.short_conv_packed(x, weight, windows, meta.cu_seqlens, meta.state_slots)
    return y.split(y.shape[-1] // parts, dim=-1)


def output_norm(
    o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
    """o [..., D] RMS-normalised over D, times weight, times sigmoid(gate) (gate like o),
    in o's dtype: fla's fused kernel on CUDA, `gated_rms_norm` elsewhere."""
    norm = fla_norm() if o.is_cuda else None
    if norm is None:
        return kda_torch.gated_rms_norm(o, weight, gate, eps)
    dim = o.shape[-1]
    y = norm(o.reshape(-1, dim), gate.reshape(-1, dim), weight, None, activation="sigmoid", eps=eps)
    return y.view(o.shape)


def kda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    meta: LinearAttentionMetadata,
    chunk_size: int = 64,
    raw: RawGates | None = None,
    decode_kernel: str = "batchgen",
) -> torch.Tensor:
    """KDA over a packed step: q, k, g [T, H, Dk] (q, k not yet normalised, g the log
    decay), v [T, H, Dv], beta [T, H] -> o [T, H, Dv] in v's dtype; each request continues
    from states[slot] and leaves its final state there. With `raw`, g is the f projection
    and beta the b projection, the gate and the sigmoid still to apply (inside the
    kernels on CUDA). `decode_kernel` is the one-token rows' kernel where the gates come
    raw: "batchgen" (kernels/kda_decode.py, the layer's: 292 us against fla's 343 at W6's
    512 rows on an H200, bench_kernels.py --kda) or "fla" (fla-core's
    fused_recurrent_kda_fwd, which given gates always take, and which the tests hold
    ours against); the same numbers."""
    if q.is_cuda and fla_kda() is not None:
        return _kda_fla(q, k, v, g, beta, states, meta, raw, decode_kernel)
    if raw is not None:
        g = kda_torch.kda_gate(g, raw.a_log, raw.dt_bias)
        beta = batch_invariant.pointwise(torch.sigmoid, beta)
    return kda_attention_torch(q, k, v, g, beta, states, meta, chunk_size)


def kda_attention_torch(q, k, v, g, beta, states, meta, chunk_size=64):
    """The reference path of kda_attention: a decode-only step as one batched recurrent
    step on device tensors; otherwise (and always in batch-invariant mode, so that a
    decode row takes one path whatever its step holds) request by request, chunked."""
    if meta.max_q_len == 1 and not batch_invariant.active():
        slots = meta.state_slots
        past = states.index_select(0, slots).transpose(-1, -2)  # the math's [N, H, Dk, Dv]
        o, new = kda_torch.kda_recurrent(q, k, v, g, beta, past)
        states.index_copy_(0, slots, new.transpose(-1, -2))
        return o
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for seq in meta.seqs:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        o, new = kda_torch.kda_chunk(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states[seq.slot].mT, chunk_size
        )
        states[seq.slot] = new.mT
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
    kda_invariant.pin_autotuners()  # one config a kernel in invariant mode
    return chunk_kda, fused_recurrent_kda_fwd


@functools.cache
def fla_norm():
    """fla-core's `rms_norm_gated` (Triton), or None where it is not installed."""
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except ImportError:
        return None
    kda_invariant.pin_autotuners()
    return rms_norm_gated


def _kda_fla(q, k, v, g, beta, states, meta, raw=None, decode_kernel="batchgen"):
    scale = q.shape[-1] ** -0.5
    gates = {}
    if raw is None:
        g = g.float()
    else:  # the gate and beta's sigmoid inside the kernels, in float32
        gates = dict(
            A_log=raw.a_log.reshape(-1),
            dt_bias=raw.dt_bias,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
        )
    step = (q, k, v, g, beta)
    if meta.max_q_len == 1:
        return _recurrent(
            step, states, meta.cu_seqlens, meta.state_slots, scale, gates, decode_kernel
        )
    split = _step_split(meta)
    if split is None:
        slots, cu, cu_host = meta.state_slots, meta.cu_seqlens, meta.cu_seqlens_host
        return _chunked(step, states, slots, cu, cu_host, scale, gates)
    # a mixed step: its one-token rows take the recurrent step in place on their slots,
    # its prefill chunks the chunked kernel (which would spend a whole chunk on each row),
    # in invariant mode first (a one-token row may be a piece's last: kda_invariant)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for chunks in (True, False) if batch_invariant.active() else (False, True):
        rows = split.prefill_rows if chunks else split.decode_rows
        taken = [_take(x, rows) for x in step]
        if chunks:  # split[4:]: the prefill rows' slots, cu_seqlens, on the device and host
            o = _chunked(taken, states, *split[4:], scale, gates)
        else:
            o = _recurrent(taken, states, split.decode_cu, split.decode_slots, scale, gates,
                           decode_kernel)  # fmt: skip
        _put(out, rows, o)
    return out


def _take(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """x's rows: a view for a slice, a gather for an index. A view whose start is not
    16-byte aligned (rows narrower than 16 bytes, as beta's with few heads) is copied:
    Triton specialises a pointer on that alignment, and a view aligned in one step and
    not in the next would compile the kernel anew mid-run."""
    if not isinstance(rows, slice):
        return x.index_select(0, rows)
    view = x[rows]
    return view if view.data_ptr() % 16 == 0 else view.clone()


def _put(out: torch.Tensor, rows: slice | torch.Tensor, o: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = o
    else:
        out.index_copy_(0, rows, o)


# the chunk length fla-core's chunk_kda takes when none is passed (as _chunked does)
FLA_CHUNK = 64


def prepare_step(meta: LinearAttentionMetadata) -> None:
    """Before the step's first kernel is queued: the chunk index fla-core's chunk_kda
    derives from a step's host-side lengths. fla builds it on the host and copies it to
    the device from pageable memory, a copy that waits for everything queued on the
    stream: made by the first KDA layer, that wait held the host while the GPU ran the
    layers before it; made before the forward, it still held the host behind a step in
    flight (async scheduling, or a mixed step queued behind a decode step). The index is
    built here instead, uploaded from pinned memory without a wait, and put in fla's
    cache (keyed by its arguments' identity) under the arguments chunk_kda passes, so
    every layer of the step finds it. Nothing on the CPU or for a decode-only step."""
    if meta.max_q_len <= 1 or not meta.cu_seqlens.is_cuda or fla_kda() is None:
        return
    split = _step_split(meta)
    if split is None:
        cu, cu_host = meta.cu_seqlens, meta.cu_seqlens_host
    else:
        cu, cu_host = split.prefill_cu, split.prefill_cu_host
    seed_chunk_indices(cu, cu_host)


def seed_chunk_indices(cu: torch.Tensor, cu_host: torch.Tensor) -> torch.Tensor:
    """The chunk index chunk_kda will ask fla's prepare_chunk_indices for, [chunks, 2]
    (each chunk's sequence, its number within it): built in numpy from `cu_host` alone,
    then moved to `cu`'s device (and dtype) through pinned memory without a wait, and
    cached as fla would cache it; returned. Not through fla's builder: its torch CPU ops
    (repeat_interleave and the like) took about 7 ms a step on the H200's host, with the
    GPU idle, where numpy takes microseconds. Where fla's cache cannot be reached
    (another fla-core), fla builds it here instead, waiting as it does."""
    from fla.ops.utils.index import prepare_chunk_indices

    keys = dict(cu_seqlens=cu, chunk_size=FLA_CHUNK, cu_seqlens_cpu=cu_host)
    cache = _identity_cache(prepare_chunk_indices)
    if cache is None:
        return prepare_chunk_indices(**keys)  # the keywords chunk_kda's forward passes
    counts = (np.diff(cu_host.numpy().astype(np.int64)) + FLA_CHUNK - 1) // FLA_CHUNK
    firsts = np.cumsum(counts) - counts  # each sequence's first chunk
    seq = np.repeat(np.arange(counts.size), counts)
    host = np.stack([seq, np.arange(int(counts.sum())) - firsts[seq]], axis=1)
    index = to_device(torch.from_numpy(host).to(cu.dtype), cu.device)
    cache.append(((), keys, index))
    return index


def _identity_cache(fn):
    """The deque of (args, kwargs, result) behind fla's `tensor_cache` decorator of fn,
    or None where fn has no such cache."""
    for cell in getattr(fn, "__closure__", None) or ():
        contents = cell.cell_contents
        if isinstance(contents, collections.deque):
            return contents
    return None


def _recurrent(step, states, cu_seqlens, slots, scale, gates, decode_kernel):
    """One token per request: the recurrent step, in place on the slots (ours where the
    gates come raw and decode_kernel says so, else fla's)."""
    if decode_kernel not in ("batchgen", "fla"):
        raise ValueError(f"decode_kernel must be 'batchgen' or 'fla', got {decode_kernel!r}")
    if decode_kernel == "batchgen" and gates:
        from batchgen.kernels.kda_decode import kda_decode

        q, k, v, f, b = step
        return kda_decode(q, k, v, f, b, gates["A_log"], gates["dt_bias"], states, slots, scale)
    _, fused_recurrent_kda_fwd = fla_kda()
    # the kernels index rows as if contiguous: the convolution kernels hand q, k and v
    # over contiguous (no copy here); the torch path's are views of one tensor
    q, k, v, g, beta = (x.contiguous().unsqueeze(0) for x in step)
    o, _ = fused_recurrent_kda_fwd(
        q, k, v, g, beta,
        initial_state=states,
        scale=scale,
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=slots,
        state_v_first=True,
        use_qk_l2norm_in_kernel=True,
        **gates,
    )  # fmt: skip
    return o[0]


def _chunked(step, states, slots, cu_seqlens, cu_seqlens_host, scale, gates):
    """Requests of several tokens: fla's chunked kernel from the slots' states, the final
    states written back."""
    chunk_kda, _ = fla_kda()
    q, k, v, g, beta = (x.contiguous().unsqueeze(0) for x in step)
    o, final = chunk_kda(
        q, k, v, g, beta,
        scale=scale,
        initial_state=states.index_select(0, slots),
        output_final_state=True,
        state_v_first=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_host,
        **gates,
    )  # fmt: skip
    states.index_copy_(0, slots, final.float())
    return o[0]


class _Split(NamedTuple):
    """A mixed step's rows by kernel: the one-token requests' rows and slots (the
    recurrent step, cu_seqlens 0..n), the longer ones' rows, slots and cu_seqlens. Rows
    are a slice where that kind's requests are packed together (the scheduler's running
    requests decode ahead of those it admits: the usual mixed step), so that the kernels
    read views of the step's tensors; else an index to gather them by."""

    decode_rows: slice | torch.Tensor
    decode_slots: torch.Tensor
    decode_cu: torch.Tensor
    prefill_rows: slice | torch.Tensor
    prefill_slots: torch.Tensor
    prefill_cu: torch.Tensor
    prefill_cu_host: torch.Tensor


def _step_split(meta: LinearAttentionMetadata) -> _Split | None:
    """The step's `_split`, built once (by prepare_step or the first KDA layer); in
    invariant mode kda_invariant.tail_split's where a piece has 64k + 1 tokens."""
    if batch_invariant.active():
        tails = derived(meta, "tails", lambda: kda_invariant.tail_split(meta, seed_chunk_indices))
        if tails is not None:
            return _Split(*tails)
    return derived(meta, "kda_split", lambda: _split(meta, meta.cu_seqlens.device))


def _split(meta: LinearAttentionMetadata, device: torch.device) -> _Split | None:
    """The step's rows split by kernel (one copy to the device), or None when it has no
    one-token request or nothing else (one chunked call takes it all)."""
    decodes = [s for s in meta.seqs if s.q_len == 1]
    prefills = [s for s in meta.seqs if s.q_len > 1]
    if not decodes or not prefills:
        return None
    nd = len(decodes)
    lens = np.array([s.q_len for s in prefills], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    blocks = _blocks(meta.seqs)
    index = []  # each kind's rows in one block: views, no gather
    if blocks is None:  # rows interleaved: gathered by index
        starts = np.array([s.q_start for s in prefills], dtype=np.int64)
        prefill_rows = np.arange(int(cu[-1])) - np.repeat(cu[:-1] - starts, lens)
        index = [[s.q_start for s in decodes], prefill_rows]
    slots = [[s.slot for s in decodes], np.arange(nd + 1), [s.slot for s in prefills], cu]
    parts = parts_to_device(index + slots, device)
    rows = parts[:2] if blocks is None else blocks
    decode_slots, decode_cu, prefill_slots, prefill_cu = parts[len(index) :]
    return _Split(rows[0], decode_slots, decode_cu, rows[1], prefill_slots, prefill_cu,
                  torch.from_numpy(cu))  # fmt: skip


def _blocks(seqs) -> tuple[slice, slice] | None:
    """The one-token requests' rows and the others', each one slice, where the first
    kind comes before or after every request of the other (the step's seqs are packed
    in order, from row 0); else None."""
    one_token = [s.q_len == 1 for s in seqs]
    if sum(a != b for a, b in zip(one_token, one_token[1:])) != 1:
        return None
    nd, end = sum(one_token), seqs[-1].q_start + seqs[-1].q_len
    if one_token[0]:
        return slice(0, nd), slice(nd, end)
    return slice(end - nd, end), slice(0, end - nd)
