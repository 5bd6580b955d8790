"""Plain-torch references of the Triton kernels that have no torch path in the package:
the tests compare each kernel with its reference (one request, one row at a time, in
float32 where the kernel accumulates in it). The references the package itself runs off
CUDA (sampling, top-p, the MoE combine) stay beside their kernels.
"""

from __future__ import annotations

import math

import torch


# batchgen.kernels.decode_attention
def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] -> float32 [B, H, D], one request at a time in plain torch."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        pages = page_table[b, : math.ceil(seq_len / page_size)]
        start = max(0, seq_len - sliding_window) if sliding_window is not None else 0
        k = k_cache[pages].flatten(0, 1)[start:seq_len].float().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[start:seq_len].float().repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


# batchgen.kernels.prefill_attention
def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> float32 [T, H, Dv] (rows of no request are zero), in plain torch;
    with q_rope and k_rope, the two parts joined first."""
    if q_rope is not None:
        q = torch.cat((q, q_rope), dim=-1)
        shape = (*k_cache.shape[:3], k_rope.shape[3])
        k_cache = torch.cat((k_cache, k_rope.expand(shape)), dim=-1)
    num_heads = q.shape[1]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = q.new_zeros(*q.shape[:2], v_cache.shape[3], dtype=torch.float32)
    specs = zip(q_start.tolist(), q_len.tolist(), seq_lens.tolist())
    for r, (start, n, seq_len) in enumerate(specs):
        pages = page_table[r, : math.ceil(seq_len / page_size)]
        k = k_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


# batchgen.kernels.mla_decode
def mla_decode_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """q_nope [B, H, C], q_pe [B, H, R] -> float32 [B, H, C], one request at a time:
    gather the request's pages, a plain softmax over its tokens (zeros for seq_len 0)."""
    if latent.dim() == 4:  # [P, S, 1, D] -> [P, S, D]
        latent = latent[:, :, 0]
    batch, num_heads, lora_rank = q_nope.shape
    page_size = latent.shape[1]
    out = torch.zeros(batch, num_heads, lora_rank, dtype=torch.float32, device=q_nope.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        pages = page_table[b, : math.ceil(seq_len / page_size)].long()
        tokens = latent[pages].flatten(0, 1)[:seq_len].float()
        c_kv, k_pe = tokens[:, :lora_rank], tokens[:, lora_rank:]
        scores = q_nope[b].float() @ c_kv.T + q_pe[b].float() @ k_pe.T
        out[b] = torch.softmax(scores * softmax_scale, dim=-1) @ c_kv
    return out


# batchgen.kernels.store_kv
def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The same write in plain torch (negative slots skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page_size = k_cache.shape[1]
    pages, offs = slots // page_size, slots % page_size
    k_cache[pages, offs] = k[keep].to(k_cache.dtype)
    v_cache[pages, offs] = v[keep].to(v_cache.dtype)


# batchgen.kernels.store_kv
def store_latent_reference(
    cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The latent write in plain torch (negative slots skipped)."""
    keep = slot_mapping >= 0
    rows = cache.view(-1, cache.shape[-1])
    rows[slot_mapping[keep]] = latent[keep].to(cache.dtype)


# batchgen.kernels.rms_norm
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch, op by op as layers/norm.py."""
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)
    return y if residual is None else (y, s)


# batchgen.kernels.qk_norm_rope
def qk_norm_rope_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch: the norm op by op as layers/norm.py, the rope in float32."""
    t, d = qkv.shape[0], cos.shape[1]
    q = qkv[:, : num_heads * d].reshape(t, num_heads, d)
    k = qkv[:, num_heads * d : (num_heads + num_kv_heads) * d].reshape(t, num_kv_heads, d)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def one(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is not None:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            x = weight * h.to(x.dtype)
        h = x.float()
        rotated = torch.cat((-h[..., d // 2 :], h[..., : d // 2]), dim=-1)
        return (h * c + rotated * s).to(qkv.dtype)

    return one(q, q_weight), one(k, k_weight)


# batchgen.kernels.mla_rope
def mla_rope_latent_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    nope_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in torch, rounded where it rounds: (q rotated, as a new tensor;
    latent)."""
    rank, dtype = norm_weight.shape[0], q.dtype
    p = positions.long()
    cos, sin = cos[p].float(), sin[p].float()

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x = x.float()
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
        c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), -1).to(dtype)

    q = q.clone()
    q[..., nope_dim:] = rope(q[..., nope_dim:], cos[:, None], sin[:, None])
    h = kv[:, :rank].float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    normed = (norm_weight.float() * h.float()).to(dtype)
    return q, torch.cat((normed, rope(kv[:, rank:], cos, sin)), -1)


# batchgen.kernels.silu_and_mul
def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The same in plain torch, as layers/activation.py."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def assert_close_relative(out: torch.Tensor, ref: torch.Tensor, bound: float = 1e-2) -> None:
    """A kernel's output (any float dtype) against its float32 reference: every value
    finite, the error's norm under bound of the reference's, and the largest error under
    3 * bound of the reference's largest value."""
    out = out.float()
    assert torch.isfinite(out).all(), "non-finite outputs (rows left unwritten?)"
    rel = ((out - ref).norm() / ref.norm()).item()
    worst = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel < bound and worst < 3 * bound, f"relative error {rel:.2e}, worst {worst:.2e}"
