"""Reference MLA attention over the latent paged cache, in plain torch.

A layer's cache holds one latent per token, [num_pages, page_size, 1, W] with
W = kv_lora_rank + rope_dim:

    latent[t] = | kv_norm(c_kv[t])  (kv_lora_rank) | k_pe[t], rope applied (rope_dim) |

Two ways to attend over it, with the same result:
- decompressed (`paged_prefill`): the latent of the whole sequence goes through kv_b_proj
  into per-head K (nope part, then the shared k_pe) and V, then plain causal attention.
  Right for prefill chunks: the queries outnumber the heads' worth of latent.
- absorbed (`paged_decode`): W_UK is folded into the query beforehand, so every head
  attends over the latent itself as one shared key/value head (K = the whole latent,
  V = its first kv_lora_rank values); W_UV is applied to the output afterwards.

Each function here is the torch twin a Triton kernel can replace. Math runs in float32.
FP8 pages (kv_cache_dtype "fp8"): the latent is quantized as it is written
(`kv_quant.write_rows`) and upcast where it is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.forward_context import AttentionMetadata
from batchgen.kv_quant import write_rows
from batchgen.layers import batch_invariant


def store_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latent [T, W] into flat slots of the [pages, page_size, 1, W] cache (cast to
    its dtype; FP8 saturated, kv_quant.to_cache)."""
    write_rows(cache.view(-1, cache.shape[-1]), slot_mapping, latent)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Q, H, Dk]; k [B, S, Hk, Dk], v [B, S, Hk, Dv] with Hk = H (decompressed) or
    1 (one latent head all heads share); allowed [B, Q, S] -> [B, Q, H, Dv] in float32."""
    b, nq, h, d = q.shape
    hk = k.shape[2]
    qg = q.float().view(b, nq, hk, h // hk, d)
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k.float()) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v.float())
    return out.reshape(b, nq, h, v.shape[-1])


def paged_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Absorbed decode, one query per decode row: q_nope [B, H, C] with W_UK folded in,
    q_pe [B, H, R] with rope applied. Every head attends over its row's latents as one
    shared head (key: all C + R values, value: the first C) -> [B, H, C] in float32,
    W_UV not yet applied. The semantics of kernels.mla_decode.mla_decode."""
    max_len = meta.decode_max_seq_len
    latent = cache[meta.decode_page_table].flatten(1, 2)[:, :max_len]  # [B, S, 1, C + R]
    k_pos = torch.arange(max_len, device=q_nope.device)[None, None, :]
    allowed = k_pos < meta.decode_seq_lens[:, None, None]
    q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)[:, None]
    if batch_invariant.active():
        q_pos = (meta.decode_seq_lens - 1)[:, None]
        v = latent[..., : q_nope.shape[-1]]
        return batch_invariant.attend(q, latent, v, q_pos, scale)[:, 0]
    out = attend(q, latent, latent[..., : q_nope.shape[-1]], allowed, scale)
    return out[:, 0]


def paged_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Decompressed prefill into out's prefill rows. q_nope [T, H, nope], q_pe [T, H,
    rope]; out [T, H, Dv]. For each prefill chunk, its sequence's cached latent [S, W]
    (the chunk's own tokens already written; an earlier chunk's or a prefix hit's before
    them) becomes K [S, H, nope + rope] (k_pe on every head) and V [S, H, Dv] through
    `expand`, and the chunk's queries attend causally, offset by the tokens cached
    before it."""
    q = torch.cat((q_nope, q_pe), dim=-1)
    for seq in meta.prefills:
        latent = cache[seq.pages].flatten(0, 1)[: seq.seq_len, 0].to(q.dtype)
        k_nope, k_pe, v = expand(latent)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, k_nope.shape[1], -1)), dim=-1)
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        q_pos = torch.arange(seq.seq_len - seq.q_len, seq.seq_len, device=q.device)[:, None]
        allowed = torch.arange(seq.seq_len, device=q.device)[None, :] <= q_pos
        out[rows] = attend(q[rows][None], k[None], v[None], allowed[None], scale)[0]


def paged_prefill_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Prefill rows attended as decode rows are, for batch-invariant mode: q_nope [T, H,
    C] with W_UK folded in, q_pe [T, H, R]; each prefill chunk's rows of out [T, H, C]
    (float32, W_UV not yet applied) get `batch_invariant.attend` over their sequence's
    latents as one shared head. A token's bits then do not depend on whether its step
    decoded it or prefilled it (a one-token chunk, a recomputed request)."""
    q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)
    c = q_nope.shape[-1]
    for seq in meta.prefills:
        latent = cache[seq.pages].flatten(0, 1)[: seq.seq_len][None]  # [1, S, 1, C + R]
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        q_pos = torch.arange(seq.seq_len - seq.q_len, seq.seq_len, device=q.device)[None]
        out[rows] = batch_invariant.attend(q[rows][None], latent, latent[..., :c], q_pos, scale)[0]
