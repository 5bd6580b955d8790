"""Kimi Delta Attention (KDA) math in plain torch: the reference every kernel is held to.

Per head, with a recurrent state S [d_k, d_v] (float32), one token t does

    S   <- diag(exp(g_t)) S                      channel-wise decay, g_t <= 0 per key dim
    u_t  = beta_t * (v_t - S^T k_t)              delta rule: what S does not yet predict
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

with q, k L2-normalised (q also scaled by d_k^-0.5). `kda_recurrent` runs that loop;
`kda_chunk` computes the same numbers a chunk of L tokens at a time (below) from a given
initial state, so a prefill may continue where an earlier step stopped. Within a chunk
that starts from S_0, with G_t the cumulative sum of g over the chunk up to t:

    A[t, s] = beta_t * sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])    s < t
    (I + A) U = beta * (V - (exp(G) * K) S_0)                   one triangular solve
    O[t]    = (exp(G_t) * q_t)^T S_0 + sum_{s <= t} P[t, s] u_s,
              P[t, s] = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])
    S_L     = exp(G_L) * S_0 + sum_s (exp(G_L - G_s) * k_s) u_s^T

Only exponents of G_t - G_s with s <= t are taken (all <= 0), so nothing overflows.

The short causal convolution (`short_conv`, and `short_conv_packed` with the same
numbers for the whole step at once) keeps per request a window of the last K - 1 inputs;
rows of a packed step belong to requests as `LinearSeq` ranges (or `cu_seqlens`) say.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.forward_context import LinearSeq
from batchgen.layers import batch_invariant


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' form, not
    F.normalize's max(norm, eps))."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Log-space per-channel decay g = -exp(A_log[h]) * softplus(f + dt_bias), float32.
    f [T, H, D] (the f_b_proj output viewed per head), a_log with H elements, dt_bias
    [H * D]."""
    heads, dim = f.shape[-2], f.shape[-1]
    x = f.float() + dt_bias.float().view(heads, dim)
    softplus = batch_invariant.pointwise(lambda t: F.softplus(t, threshold=20.0), x)
    return -torch.exp(a_log.float().reshape(heads, 1)) * softplus


def gated_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm over the last dim in float32, times weight, times sigmoid(gate); x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    gate = batch_invariant.pointwise(torch.sigmoid, gate.float())
    return (weight.float() * h * gate).to(x.dtype)


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    return q, l2_normalize(k.float())


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence, a batch of N sequences at once (the decode step).
    q, k [N, H, Dk] (not yet normalised), v [N, H, Dv], g [N, H, Dk], beta [N, H],
    state [N, H, Dk, Dv] float32 (not written) -> (o [N, H, Dv] in v's dtype, new state)."""
    q, k = _prepare(q, k)
    s = state.float() * torch.exp(g.float()).unsqueeze(-1)
    predicted = torch.einsum("nhkv,nhk->nhv", s, k)
    u = beta.float().unsqueeze(-1) * (v.float() - predicted)
    s = s + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = torch.einsum("nhkv,nhk->nhv", s, q)
    return o.to(v.dtype), s


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk by chunk, continuing from `state`: q, k, g [T, H, Dk], v
    [T, H, Dv], beta [T, H], state [H, Dk, Dv] -> (o [T, H, Dv], final state), the numbers
    of `kda_recurrent` run token by token (the last chunk may be short; nothing is
    padded)."""
    q, k = _prepare(q, k)
    v32, g32, b32 = v.float(), g.float(), beta.float()
    s = state.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for start in range(0, q.shape[0], chunk_size):
        end = min(start + chunk_size, q.shape[0])
        out[start:end], s = _chunk_step(
            q[start:end], k[start:end], v32[start:end], g32[start:end], b32[start:end], s
        )
    return out.to(v.dtype), s


def _chunk_step(q, k, v, g, beta, s0):
    """One chunk of L tokens, all float32, heads first inside: see the module doc."""
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, L, D]
    beta = beta.transpose(0, 1)  # [H, L]
    length = q.shape[1]
    cum = g.cumsum(1)  # G [H, L, Dk]
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)  # [H, t, s, Dk] = G_t - G_s
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal[None, :, :, None], diff, float("-inf")).exp()
    k_pairs = torch.einsum("htc,hsc,htsc->hts", k, k, decay)
    a = (beta.unsqueeze(-1) * k_pairs).tril(-1)
    eye = torch.eye(length, dtype=a.dtype, device=a.device)
    rhs = beta.unsqueeze(-1) * (v - (torch.exp(cum) * k) @ s0)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    p = torch.einsum("htc,hsc,htsc->hts", q, k, decay)
    o = (torch.exp(cum) * q) @ s0 + p @ u
    last = cum[:, -1:, :]  # G_L [H, 1, Dk]
    s = torch.exp(last).transpose(1, 2) * s0 + (torch.exp(last - cum) * k).transpose(1, 2) @ u
    return o.transpose(0, 1), s


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    seqs: list[LinearSeq],
) -> torch.Tensor:
    """Depthwise causal convolution + SiLU over a packed step, request by request (the
    reference of `short_conv_packed`). x [T, C]; weight [C, K]; windows [num_slots, K - 1,
    C], the last K - 1 inputs of each slot's request (zeros for a new one), read and
    rewritten for every seq -> [T, C] in x's dtype."""
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    for seq in seqs:
        rows = x[seq.q_start : seq.q_start + seq.q_len]
        ext = torch.cat([windows[seq.slot].to(x.dtype), rows])  # [K - 1 + n, C]
        out[seq.q_start : seq.q_start + seq.q_len] = _conv_rows(ext, weight, seq.q_len)
        windows[seq.slot] = ext[ext.shape[0] - width :].to(windows.dtype)
    return out


def short_conv_packed(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`short_conv` for every request of the step at once, the same numbers: a fixed
    number of gathers whatever the mix of prefill chunks and single rows, no host ints.
    cu_seqlens [S + 1] and slots [S] int64 on x's device.

    Each request sees its window followed by its rows, ext = window ++ rows; tap j of its
    row p reads ext[p + j]. Both come from one source tensor, src = x ++ the step's
    windows (K - 1 rows per request, in packed order), through `conv_gather_index`."""
    taps = weight.shape[1]
    taps_at, tails_at = conv_gather_index(cu_seqlens, x.shape[0], taps)
    past = windows.index_select(0, slots).to(x.dtype)  # [S, K - 1, C]
    src = torch.cat([x, past.flatten(0, 1)])
    out = src[taps_at[:, 0]].to(weight.dtype) * weight[:, 0]
    for j in range(1, taps):
        out = out + src[taps_at[:, j]].to(weight.dtype) * weight[:, j]
    windows.index_copy_(0, slots, src[tails_at].to(windows.dtype))
    return batch_invariant.pointwise(F.silu, out).to(x.dtype)


def conv_gather_index(
    cu_seqlens: torch.Tensor, num_rows: int, taps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of src = x [num_rows] ++ windows [S * (K - 1)] that `short_conv_packed`
    gathers: per packed row its K taps [num_rows, K], and per request its new window, the
    last K - 1 rows of ext, [S, K - 1]. Position e of a request's ext is window row e
    (src row num_rows + s * (K - 1) + e) while e < K - 1, else its row e - (K - 1)."""
    width = taps - 1
    device = cu_seqlens.device
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    rows = torch.arange(num_rows, device=device)
    seq = torch.searchsorted(ends, rows, right=True)  # the request of each packed row
    ext = (rows - starts[seq]).unsqueeze(1) + torch.arange(taps, device=device)  # [T, K]
    from_x = rows.unsqueeze(1) - width + torch.arange(taps, device=device)
    from_window = num_rows + seq.unsqueeze(1) * width + ext
    taps_at = torch.where(ext >= width, from_x, from_window)
    s = torch.arange(starts.shape[0], device=device).unsqueeze(1)
    tail = (ends - starts).unsqueeze(1) + torch.arange(width, device=device)  # [S, K - 1]
    tails_at = torch.where(
        tail >= width, starts.unsqueeze(1) + tail - width, num_rows + s * width + tail
    )
    return taps_at, tails_at


def short_conv_decode(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One new row per request (every request has a window): x [N, C], slots [N] int64
    -> [N, C]; windows of those slots shift by one row. No host synchronisation."""
    past = windows.index_select(0, slots).to(x.dtype)  # [N, K - 1, C]
    ext = torch.cat([past, x.unsqueeze(1)], dim=1)  # [N, K, C]
    out = torch.einsum("nkc,ck->nc", ext.to(weight.dtype), weight)
    windows.index_copy_(0, slots, ext[:, 1:].to(windows.dtype))
    return F.silu(out).to(x.dtype)


def _conv_rows(ext: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """out[t] = silu(sum_j weight[:, j] * ext[t + j]) for t < n."""
    ext = ext.to(weight.dtype)
    taps = weight.shape[1]
    out = sum(ext[j : j + n] * weight[:, j] for j in range(taps))
    return F.silu(out)
